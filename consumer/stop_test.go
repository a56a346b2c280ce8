package consumer

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// A handler still running during a graceful stop stays kept alive: a second instance of the
// durable does not get its message while it runs (no redelivery, no duplicate), and the
// effect happens once.
func TestStopKeepsRunningHandlerAlive(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int32
	started := make(chan struct{}, 1)
	const ackWait = 300 * time.Millisecond
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		runs.Add(1)
		select {
		case started <- struct{}{}:
		default:
		}
		time.Sleep(3 * ackWait) // slow work: three ack waits
		return recordEffect(ctx, tx, msg)
	}
	cfg := func() *Config { return &Config{AckWait: ackWait, Concurrency: 1, StopTimeout: 10 * time.Second} }
	first := e.newConsumer(nil, cfg(), h)
	stopFirst := e.run(first)
	e.publishID("orders.created", newID(), "slow")
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not start")
	}

	nc, err := testsvc.Connect(e.nats.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	waiting := e.consumerInfo(testDurable).NumWaiting
	second := e.newConsumer(js, cfg(), h)
	e.run(second)
	testsvc.Eventually(t, 10*time.Second, "the second instance to pull", func() bool { return e.consumerInfo(testDurable).NumWaiting > waiting })

	if err := stopFirst(); err != nil { // returns once the handler committed and acked
		t.Fatalf("Run: %v", err)
	}
	// Once the ack is in, no redelivery can come; one before it is counted by JetStream.
	testsvc.Eventually(t, 10*time.Second, "the ack to reach JetStream", func() bool { return e.consumerInfo(testDurable).NumAckPending == 0 })

	if n := e.effects(); n != 1 {
		t.Errorf("effects: %d, want 1", n)
	}
	d1, d2 := first.Stats().Duplicates, second.Stats().Duplicates
	if r := runs.Load(); r != 1 || d1 != 0 || d2 != 0 {
		t.Errorf("handler runs %d, duplicates %d and %d; want 1, 0 and 0", r, d1, d2)
	}
	if info := e.consumerInfo(testDurable); info.NumRedelivered != 0 || info.NumAckPending != 0 {
		t.Errorf("redelivered %d, ack pending %d; want 0 and 0", info.NumRedelivered, info.NumAckPending)
	}
}

// Once the stop has begun, a worker that finishes its message does not start the handler of
// a queued one: the queued messages are nak'ed, and the next instance handles them at once.
func TestStopStartsNoQueuedHandler(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int32
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		if runs.Add(1) == 1 {
			started <- struct{}{}
			<-release
		}
		return recordEffect(ctx, tx, msg)
	}
	for range 3 {
		e.publishID("orders.created", newID(), "x")
	}
	c := e.newConsumer(nil, &Config{Concurrency: 1, AckWait: 30 * time.Second}, h)
	// The running handler finishes after the stop began, while the consumer still holds the
	// two queued messages; the stop goes on once the worker returned (a worker that took a
	// queued message would run its handler first, and runs would show it).
	// (No t.Fatal here: the hook runs on Run's goroutine.)
	c.testSignals.workerReturned.Init()
	c.hooks.stopping = func() {
		close(release)
		select {
		case <-c.testSignals.workerReturned.C():
		case <-time.After(10 * time.Second):
			t.Error("the worker did not return after its handler finished")
		}
	}
	stop := e.run(c)
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not start")
	}
	testsvc.Eventually(t, 5*time.Second, "all three delivered", func() bool { return e.consumerInfo(testDurable).NumAckPending == 3 })
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if r, n := runs.Load(), e.effects(); r != 1 || n != 1 {
		t.Fatalf("handler runs %d, effects %d after the stop; want 1 and 1 (only the message in flight)", r, n)
	}
	// The queued ones were nak'ed: the next instance gets them now, not after the ack wait.
	next := e.newConsumer(nil, &Config{Concurrency: 1, AckWait: 30 * time.Second}, recordEffect)
	e.run(next)
	testsvc.Eventually(t, 10*time.Second, "the rest, well before the ack wait", func() bool { return e.effects() >= 3 })
	if n := e.effects(); n != 3 || next.Stats().Duplicates != 0 {
		t.Fatalf("effects %d, duplicates %d; want 3 and 0", n, next.Stats().Duplicates)
	}
}
