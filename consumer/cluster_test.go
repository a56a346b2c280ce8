package consumer

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// A consumer started while its stream has no leader (two of three nodes down: no quorum)
// waits — one warning, Run does not return — and consumes once a node is back; a stream that
// does not exist is an answer, not an outage: Run returns at once. The consumer is ordered:
// its start also looks the stream up (to read the key order back), in the same waiting passes.
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
		handled <- string(m.Payload)
		return nil
	}, &Config{Stream: "CL", Durable: "cl", Schema: db.Schema, AckWait: 2 * time.Second, Ordered: true, Logger: quietLogger()})
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
	cl.StartForQuorum(t, "CL", other, 30*time.Second)
	var lastErr error
	testsvc.Eventually(t, 60*time.Second, "a publish to the stream once it has a leader again", func() bool {
		pctx, pcancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer pcancel()
		_, lastErr = cl.JS.Publish(pctx, "cl.x", []byte("after the election"), jetstream.WithMsgID("after-the-election"))
		if lastErr != nil && time.Since(at) > 55*time.Second {
			t.Logf("publish: %v; cluster: %s", lastErr, cl.Describe("CL"))
		}
		return lastErr == nil
	})
	published := time.Now()
	select {
	case got := <-handled:
		if got != "after the election" {
			t.Fatalf("handled %q", got)
		}
	case err := <-done:
		t.Fatalf("Run returned %v", err)
	case <-time.After(20 * time.Second):
		// The pull made while the stream had no leader was answered by no responders; the
		// client pulls again after two missing heartbeats (Config.PullHeartbeat, 2.5s), where
		// with nats.go's defaults it waited for its 30s pull expiry.
		t.Fatal("the message was not handled within 20s of the publish (expected about 5s)")
	}
	t.Logf("node back → message handled: %s (publish → handled: %s)", time.Since(at).Round(time.Millisecond), time.Since(published).Round(time.Millisecond))
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

// A running consumer whose durable loses its leader (SIGKILL of the node) resumes soon after a
// new one is elected. The consumer's connection is to a node that stays up, so no reconnect
// pulls again on its behalf: the server side hands the pull over (measured here: within
// milliseconds to about 6s), and missing heartbeats (Config.PullHeartbeat) would catch a pull
// that was lost.
func TestClusterConsumerResumesAfterLeaderKill(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	cl := testsvc.JetStreamCluster(t)
	cl.Stream(t, "CR", "cr.>")
	cl.Stream(t, "CR_DEAD", DefaultDeadLetterPrefix+">")
	home := cl.Nodes[0]
	nc, err := testsvc.Connect(home.URL())
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
		handled <- string(m.Payload)
		return nil
	}, &Config{Stream: "CR", Durable: "cr", Schema: db.Schema, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	publish := func(data string) bool {
		pctx, pcancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer pcancel()
		_, err := cl.JS.Publish(pctx, "cr.x", []byte(data), jetstream.WithMsgID(data))
		return err == nil
	}
	testsvc.Eventually(t, 30*time.Second, "a publish before the election", func() bool { return publish("before") })
	if got := testsvc.Receive(t, handled, 30*time.Second, "the message before the election"); got != "before" {
		t.Fatalf("handled %q", got)
	}

	// The durable's leader, on another node than the consumer's connection.
	var leader *embedded.ClusterNode
	testsvc.Eventually(t, 60*time.Second, "the durable led by a node the consumer is not connected to", func() bool {
		leader = nil
		for _, n := range cl.Nodes {
			if s := n.Server(); s != nil && s.JetStreamIsConsumerLeader(embedded.GlobalAccount, "CR", "cr") {
				leader = n
			}
		}
		if leader == home {
			_, _ = cl.Conn.Request(fmt.Sprintf("$JS.API.CONSUMER.LEADER.STEPDOWN.%s.%s", "CR", "cr"), nil, 2*time.Second)
		}
		return leader != nil && leader != home
	})
	leader.Kill()
	t.Cleanup(func() { _ = leader.Start() })
	testsvc.Eventually(t, 60*time.Second, "a publish once the stream has a leader", func() bool { return publish("after") })
	at := time.Now()
	select {
	case got := <-handled:
		if got != "after" {
			t.Fatalf("handled %q", got)
		}
	case err := <-done:
		t.Fatalf("Run returned %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("the message published after the election was not handled within 20s")
	}
	t.Logf("killed durable leader %s; publish → handled: %s", leader.Name, time.Since(at).Round(time.Millisecond))
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
}
