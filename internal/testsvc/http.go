package testsvc

import (
	"io"
	"net/http"
	"testing"
)

// HTTPGet fetches url and returns its body and status code; a failed request fails the test.
func HTTPGet(tb testing.TB, url string) (string, int) {
	tb.Helper()
	resp, err := http.Get(url)
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		tb.Fatal(err)
	}
	return string(b), resp.StatusCode
}
