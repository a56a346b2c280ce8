package natsver

import (
	"errors"
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox"
)

func TestLess(t *testing.T) {
	cases := []struct {
		a, b string
		less bool
	}{
		{"2.9.0", "2.10.0", true}, // numeric, not textual
		{"2.10.0", "2.9.0", false},
		{"2.10.0", "2.10.0", false},
		{"2.10.29", "2.11.0", true},
		{"v2.12.1", "2.10.0", false},
		{"2.10.0-RC.1", "2.10.0", true}, // a pre-release is older than its release
		{"2.10.0", "2.10.0-RC.1", false},
		{"2.10.0-RC.2", "2.10.0-RC.10", true},
		{"2.10.0-beta", "2.10.0-RC.1", false}, // text order: "RC" < "beta"
		{"2.11.0+build.5", "2.11.0", false},
		{"1.99.99", "2.2.0", true},
		{"3.0.0", "2.99.99", false},
	}
	for _, c := range cases {
		got, err := Less(c.a, c.b)
		if err != nil || got != c.less {
			t.Errorf("Less(%q, %q) = %v, %v; want %v", c.a, c.b, got, err, c.less)
		}
	}
	for _, bad := range []string{"", "2.10", "2.x.0", "2.10.0.1", "-1.0.0"} {
		if _, err := Less(bad, "2.10.0"); err == nil {
			t.Errorf("Less(%q) parsed", bad)
		}
	}
}

func TestCheckVersion(t *testing.T) {
	err := CheckVersion("2.9.25", "consumer", "more than one filter subject", "2.10.0")
	var ve *txoutbox.ServerVersionError
	if !errors.Is(err, txoutbox.ErrServerTooOld) || !errors.As(err, &ve) || ve.Server != "2.9.25" || ve.Required != "2.10.0" {
		t.Fatalf("err = %v (%#v)", err, ve)
	}
	for _, want := range []string{"2.9.25", "2.10.0", "consumer", "more than one filter subject"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q does not name %q", err, want)
		}
	}
	// Only a server known to be too old is refused.
	for _, server := range []string{"2.10.0", "2.12.3", "", "not-a-version"} {
		if err := CheckVersion(server, "consumer", "x", "2.10.0"); err != nil {
			t.Errorf("CheckVersion(%q) = %v", server, err)
		}
	}
	if err := Check(nil, "relay", "x", "2.9.0"); err != nil {
		t.Errorf("Check(nil) = %v", err)
	}
}
