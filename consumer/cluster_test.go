package consumer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// A consumer started while its stream has no leader (two of three nodes down: no quorum)
// waits — one warning, Run does not return — and consumes once a node is back; a stream that
// does not exist is an answer, not an outage: Run returns at once.
func TestClusterConsumerStartedDuringElectionWaits(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	cl := testsvc.JetStreamCluster(t)
	cl.Stream(t, "CL", "cl.>")
	cl.Stream(t, "CL_DEAD", DefaultDeadLetterPrefix+">")

	// Two of three nodes down, the leader among them.
	leader := cl.KillLeader(t, "CL")
	var other *embedded.ClusterNode
	for _, n := range cl.Nodes {
		if n != leader {
			other = n
			break
		}
	}
	other.Stop()

	nc, err := testsvc.Connect(cl.URLs())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	handled := make(chan string, 4)
	c, err := New(db.Pool, js, func(_ context.Context, _ pgx.Tx, m Message) error {
		handled <- string(m.Data)
		return nil
	}, &Config{Stream: "CL", Durable: "cl", Schema: db.Schema, AckWait: 2 * time.Second, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	waits := make(chan error, 16)
	c.hooks.setupWait = func(err error) { waits <- err }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	for i := 0; i < 2; i++ { // two failed passes: it waits, it does not give up
		select {
		case err := <-waits:
			t.Logf("setup pass %d: %v", i+1, err)
		case err := <-done:
			t.Fatalf("Run returned %v while the stream had no leader, want it to wait", err)
		case <-time.After(30 * time.Second):
			t.Fatal("no setup pass reported")
		}
	}

	at := time.Now()
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	testsvc.Eventually(t, 60*time.Second, "a publish to the stream once it has a leader again", func() bool {
		pctx, pcancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer pcancel()
		_, err := cl.JS.Publish(pctx, "cl.x", []byte("after the election"), jetstream.WithMsgID("after-the-election"))
		return err == nil
	})
	select {
	case got := <-handled:
		if got != "after the election" {
			t.Fatalf("handled %q", got)
		}
	case err := <-done:
		t.Fatalf("Run returned %v", err)
	case <-time.After(90 * time.Second):
		// A pull that met the election is answered by no responders; the client pulls again
		// after its pull expiry (30s).
		t.Fatal("the message was not handled")
	}
	t.Logf("node back → message handled: %s", time.Since(at).Round(time.Millisecond))
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}

	// A stream that does not exist: the answer is final.
	missing, err := New(db.Pool, js, func(context.Context, pgx.Tx, Message) error { return nil },
		&Config{Stream: "NO_SUCH_STREAM", Durable: "cl2", Schema: db.Schema, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	rctx, rcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer rcancel()
	if err := missing.Run(rctx); err == nil || rctx.Err() != nil || !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("Run on a missing stream: %v (context %v), want ErrStreamNotFound at once", err, rctx.Err())
	}
}
