package testsvc

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// Logger is the logger tests give the components: debug lines on stderr with -v, nothing
// otherwise.
func Logger() *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// Eventually polls cond every 10ms until it returns true, and fails the test with what (what
// was being waited for) when timeout passes first. It is for conditions that are observable
// only by looking (a row's state, a stream's length); a component's own event (a channel it
// signals) is waited on directly.
func Eventually(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		<-tick.C
	}
}

// Receive waits for a value on ch, failing the test with what when timeout passes first.
func Receive[T any](tb testing.TB, ch <-chan T, timeout time.Duration, what string) T {
	tb.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(timeout):
		tb.Fatalf("timed out after %s waiting for %s", timeout, what)
		var zero T
		return zero
	}
}

// The relay command, built once per test binary (Main removes it).
var (
	relayOnce sync.Once
	relayDir  string
	relayPath string
	relayErr  error
)

// RelayBinary builds ./cmd/relay (with the txoutbox_fault tag) once per test binary and
// returns its path.
func RelayBinary(tb testing.TB) string {
	tb.Helper()
	relayOnce.Do(func() {
		if relayDir, relayErr = os.MkdirTemp("", "txoutbox-relay-bin-"); relayErr != nil {
			return
		}
		relayPath = filepath.Join(relayDir, "relay")
		// With the fault points (the crash tests arm them). Static (the container test copies
		// it into an image FROM scratch), and stamped with the VCS information when the
		// checkout allows it (relay version reports it; a GOFLAGS of -buildvcs=false in the
		// environment would otherwise drop it).
		cmd := exec.Command(GoTool(), "build", "-tags", "txoutbox_fault", "-buildvcs=auto", "-o", relayPath, "github.com/txoutbox/txoutbox/cmd/relay")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		out, err := cmd.CombinedOutput()
		if err != nil {
			relayErr = fmt.Errorf("%w\n%s", err, out)
		}
	})
	if relayErr != nil {
		tb.Fatalf("testsvc: go build ./cmd/relay: %v", relayErr)
	}
	return relayPath
}

// GoTool is the go command: the one on PATH, else the one in `go env GOROOT`'s bin directory
// as the GOROOT environment variable names it.
func GoTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	if root := os.Getenv("GOROOT"); root != "" {
		return filepath.Join(root, "bin", "go")
	}
	return "go"
}
