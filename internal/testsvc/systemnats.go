package testsvc

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// SystemNATS starts the nats-server binary installed on the machine (TXOUTBOX_SYSTEM_NATS_SERVER,
// else nats-server on PATH or in /usr/sbin: Debian's package, an older release than the
// embedded server) with JetStream, on a port and a store of the test's own, and stops it when
// the test ends. It skips the test, saying why, when there is no such binary. It is how tests
// meet a real older server, where the embedded one is always the module's version.
func SystemNATS(tb testing.TB) (version string, nc *nats.Conn, js jetstream.JetStream) {
	tb.Helper()
	bin := os.Getenv("TXOUTBOX_SYSTEM_NATS_SERVER")
	if bin == "" {
		if p, err := exec.LookPath("nats-server"); err == nil {
			bin = p
		} else if _, err := os.Stat("/usr/sbin/nats-server"); err == nil {
			bin = "/usr/sbin/nats-server"
		}
	}
	if bin == "" {
		tb.Skip("skipping: no nats-server binary on this machine (apt-get install nats-server, or set TXOUTBOX_SYSTEM_NATS_SERVER)")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	dir := tb.TempDir()
	cmd := exec.Command(bin, "-a", "127.0.0.1", "-p", strconv.Itoa(port), "-js", "-sd", filepath.Join(dir, "js"))
	logf, err := os.Create(filepath.Join(dir, "nats-server.log"))
	if err != nil {
		tb.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		tb.Fatalf("testsvc: start %s: %v", bin, err)
	}
	tb.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = logf.Close()
	})
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	deadline := time.Now().Add(15 * time.Second)
	for {
		nc, err = nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			out, _ := os.ReadFile(filepath.Join(dir, "nats-server.log"))
			tb.Fatalf("testsvc: %s did not answer on %s: %v\n%s", bin, url, err, out)
		}
		time.Sleep(20 * time.Millisecond) // polling a starting server's port
	}
	tb.Cleanup(nc.Close)
	if js, err = jetstream.New(nc); err != nil {
		tb.Fatal(err)
	}
	return nc.ConnectedServerVersion(), nc, js
}
