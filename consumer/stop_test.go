package consumer

import (
	"context"
	"database/sql"
	"errors"
	"strings"
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
	release := make(chan struct{})
	const ackWait = 300 * time.Millisecond
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		runs.Add(1)
		select {
		case started <- struct{}{}:
		default:
		}
		<-release // slow work: until the stop has kept it alive for three ack waits
		return recordEffect(ctx, tx, msg)
	}
	cfg := func() *Config { return &Config{AckWait: ackWait, Concurrency: 1, StopTimeout: 10 * time.Second} }
	first := e.newConsumer(nil, cfg(), h)
	first.testSignals.keptAlive.Init()
	first.testSignals.stopWaits.Init()
	stopFirst := e.run(first)
	e.publishID("orders.created", newID(), "slow")
	testsvc.Receive(t, started, 10*time.Second, "the handler to start")

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

	stopped := make(chan error, 1)
	go func() { stopped <- stopFirst() }() // returns once the handler committed and acked
	testsvc.Receive(t, first.testSignals.stopWaits.C(), 10*time.Second, "the stop to wait for the handler")
	for len(first.testSignals.keptAlive.C()) > 0 { // the acks sent before the stop
		<-first.testSignals.keptAlive.C()
	}
	waitKeptAlive(t, first, 3*ackWait)
	close(release)
	if err := testsvc.Receive(t, stopped, 30*time.Second, "Run to return"); err != nil {
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
	testsvc.Receive(t, started, 10*time.Second, "the handler to start")
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

// A handler the stop timeout cancels is no outage: its message is nak'ed at once (the next
// instance takes it long before the ack wait), no attempt and no unavailability is counted,
// and nothing but the stop timeout itself is logged as a warning. In every mode: per message,
// batch, set-based batch (NewBatch) and database/sql (NewSQL).
func TestStopTimeoutCancellationIsNoOutage(t *testing.T) {
	t.Parallel()
	type mode struct {
		name  string
		build func(e *env, cfg *Config, started chan<- struct{}) *Consumer
	}
	block := func(ctx context.Context, started chan<- struct{}) error {
		started <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	}
	modes := []mode{
		{"per message", func(e *env, cfg *Config, started chan<- struct{}) *Consumer {
			return e.newConsumer(nil, cfg, func(ctx context.Context, _ pgx.Tx, _ Message) error { return block(ctx, started) })
		}},
		{"batch", func(e *env, cfg *Config, started chan<- struct{}) *Consumer {
			cfg.BatchSize = 4
			return e.newConsumer(nil, cfg, func(ctx context.Context, _ pgx.Tx, _ Message) error { return block(ctx, started) })
		}},
		{"NewBatch", func(e *env, cfg *Config, started chan<- struct{}) *Consumer {
			c, err := NewBatch(e.db.Pool, e.nats.JS, func(ctx context.Context, _ pgx.Tx, _ []Message) error { return block(ctx, started) }, e.config(cfg))
			if err != nil {
				t.Fatal(err)
			}
			return c
		}},
		{"NewSQL", func(e *env, cfg *Config, started chan<- struct{}) *Consumer {
			return e.newSQLConsumer(e.openSQL("pgx"), cfg, func(ctx context.Context, _ *sql.Tx, _ Message) error { return block(ctx, started) })
		}},
	}
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			var logs testsvc.LogBuffer
			started := make(chan struct{}, 1)
			const ackWait = 30 * time.Second
			c := m.build(e, &Config{Concurrency: 1, AckWait: ackWait, StopTimeout: 50 * time.Millisecond, Logger: logs.Logger()}, started)
			e.publishID("orders.created", newID(), "blocked")
			stop := e.run(c)
			testsvc.Receive(t, started, 10*time.Second, "the handler to start")
			if err := stop(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			if s := c.Stats(); s.Unavailable != 0 || s.Retries != 0 || s.DeadLettered != 0 || s.Processed != 0 {
				t.Errorf("stats %+v; want no unavailability, retry, dead letter or processed message", s)
			}
			if c.pgDown.Load() {
				t.Error("postgres marked down by the cancellation")
			}
			out := logs.String()
			if !strings.Contains(out, "cancelling them") {
				t.Errorf("the stop timeout was not logged:\n%s", out)
			}
			for _, line := range strings.Split(out, "\n") {
				if strings.Contains(line, "put back") || strings.Contains(line, "context canceled") ||
					(strings.Contains(line, `"level":"WARN"`) || strings.Contains(line, `"level":"ERROR"`)) && !strings.Contains(line, "cancelling them") {
					t.Errorf("logged: %s", line)
				}
			}
			// Nak'ed: the next instance gets it now, not after the ack wait.
			next := e.newConsumer(nil, &Config{Concurrency: 1, AckWait: ackWait}, recordEffect)
			e.run(next)
			testsvc.Eventually(t, ackWait/3, "the message, well before the ack wait", func() bool { return e.effects() == 1 })
		})
	}
}

// Setup's check of the key-order table (ordered mode) returns a cancellation instead of
// warning that the database does not answer.
func TestKeyOrderCheckCancelledIsNotLogged(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var logs testsvc.LogBuffer
	c := e.newConsumer(nil, &Config{Ordered: true, Logger: logs.Logger()}, recordEffect)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := c.checkTables(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("checkTables(cancelled): %v; want context.Canceled", err)
	}
	if out := logs.String(); out != "" {
		t.Errorf("logged:\n%s", out)
	}
	if err := c.checkTables(context.Background()); err != nil {
		t.Errorf("checkTables: %v", err)
	}
}
