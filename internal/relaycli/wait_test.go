package relaycli

import (
	"syscall"
	"testing"
	"time"

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
	p.waitLog(t, "waiting for NATS to answer", 15*time.Second)
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
