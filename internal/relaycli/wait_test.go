package relaycli

import (
	"errors"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// A relay started while NATS is down waits for it (one warning), starts when it comes, and
// still stops cleanly; a one-shot command does not wait.
func TestRelayWaitsForNATSAtStart(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	n.Stop()
	p := startRelay(t, "relay-wait", "run", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema,
		"--log-format", "json", "--log-level", "debug", "--no-checkback")
	l := p.waitLog(t, "waiting for NATS to answer", 15*time.Second)
	// The real cause, not only nats.go's "no servers available" (which hides a refused
	// connection) and never <nil>.
	if err, _ := l.Fields["err"].(string); !strings.Contains(err, "no servers available") || !strings.Contains(err, "connection refused") {
		t.Errorf("waiting line's err = %q, want nats.go's error and the refused connection behind it", err)
	}
	// Several retries (each a debug line): still one warning.
	testsvc.Eventually(t, 15*time.Second, "two more attempts to reach NATS", func() bool { return len(p.find("still waiting for NATS")) >= 2 })
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	p.waitLog(t, "PostgreSQL and NATS answer; starting", 15*time.Second)
	p.waitLog(t, "relay started", 15*time.Second)
	if w := len(p.find("waiting for NATS to answer")); w != 1 {
		t.Fatalf("%d waiting lines, want 1", w)
	}
	if code := p.stop(t, syscall.SIGTERM); code != 0 {
		t.Fatalf("exit %d after SIGTERM, want 0", code)
	}

	// Stopped while waiting: exit 0 too.
	n.Stop()
	q := startRelay(t, "relay-wait-2", "run", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema,
		"--log-format", "json", "--no-checkback")
	q.waitLog(t, "waiting for NATS to answer", 15*time.Second)
	if code := q.stop(t, syscall.SIGTERM); code != 0 {
		t.Fatalf("exit %d after SIGTERM while waiting, want 0", code)
	}
}

// natsRefusedCause adds the dial error behind nats.go's ErrNoServers, for the first server
// that refuses, and leaves other errors and reachable servers alone.
func TestNATSRefusedCause(t *testing.T) {
	t.Parallel()
	n := testsvc.NewNATS(t)
	up := n.URL()
	n2 := testsvc.NewNATS(t)
	down := n2.URL()
	n2.Stop()
	err := natsRefusedCause(up+", "+down, nats.ErrNoServers)
	var op *net.OpError
	if !errors.Is(err, nats.ErrNoServers) || !errors.As(err, &op) || !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("natsRefusedCause(up, down) = %v, want ErrNoServers and the refused dial", err)
	}
	if err := natsRefusedCause(up, nats.ErrNoServers); err != nats.ErrNoServers {
		t.Fatalf("natsRefusedCause(up) = %v, want ErrNoServers alone", err)
	}
	other := errors.New("other")
	if err := natsRefusedCause(down, other); err != other {
		t.Fatalf("natsRefusedCause(down, other) = %v, want other unchanged", err)
	}
	if !natsWaitable(natsRefusedCause(down, nats.ErrNoServers)) {
		t.Fatal("a refused connection with its cause is not waited for")
	}
	// A server given without a scheme, as nats.go takes it (nats:// added), with or without
	// credentials: the same cause.
	hostPort := strings.TrimPrefix(down, "nats://")
	for _, u := range []string{hostPort, "u:Secret@" + hostPort, up + "," + hostPort} {
		if err := natsRefusedCause(u, nats.ErrNoServers); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("natsRefusedCause(%q) = %v, want ErrNoServers and the refused dial", u, err)
		}
	}
}
