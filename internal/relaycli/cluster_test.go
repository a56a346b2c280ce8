package relaycli

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// relay run started while its stream has no leader (two of three nodes down: neither the
// stream nor the cluster's meta group has a quorum) waits, says so once, and runs once a
// leader is elected; it does not exit.
func TestRunStartedDuringElectionWaits(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	c := testsvc.JetStreamCluster(t)
	c.Stream(t, "ACC", "acc.>")
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(context.Background(), db.Pool, func(tx pgx.Tx) error {
		_, err := client.EnqueueTx(context.Background(), tx, outbox.Message{Subject: "acc.x", Key: "k", Payload: []byte("1")})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	leader := c.KillLeader(t, "ACC")
	var other *embedded.ClusterNode
	for _, n := range c.Nodes {
		if n != leader {
			other = n
			break
		}
	}
	other.Kill()

	p := startRelay(t, "relay-election", "run", "--database-url", db.DSN, "--nats-url", c.URLs(), "--schema", db.Schema,
		"--subjects", "acc.>", "--publish-timeout", "1s", "--log-format", "json", "--log-level", "debug", "--no-checkback")
	const waiting = "waiting for JetStream to answer the start-up stream check"
	p.waitLog(t, waiting, 30*time.Second)
	p.waitLog(t, "still waiting for JetStream to answer the start-up stream check", 30*time.Second) // a second pass
	if n := len(p.find(waiting)); n != 1 {
		t.Fatalf("%d waiting warnings, want 1", n)
	}
	if n := len(p.find("relay started")); n != 0 {
		t.Fatal("the relay started while the stream had no leader")
	}

	c.StartForQuorum(t, "ACC", other, 30*time.Second)
	p.waitLog(t, "streams checked: JetStream answers", 60*time.Second)
	p.waitLog(t, "relay started", 10*time.Second)
	testsvc.Eventually(t, 30*time.Second, "the row published", func() bool {
		var n int
		if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM txoutbox_messages").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
	if code := p.stop(t, syscall.SIGTERM); code != 0 {
		t.Fatalf("exit %d after SIGTERM, want 0", code)
	}
}
