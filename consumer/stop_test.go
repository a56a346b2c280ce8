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
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		runs.Add(1)
		select {
		case started <- struct{}{}:
		default:
		}
		time.Sleep(3 * time.Second) // three ack waits
		return recordEffect(ctx, tx, msg)
	}
	cfg := func() *Config { return &Config{AckWait: time.Second, Concurrency: 1, StopTimeout: 10 * time.Second} }
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
	second := e.newConsumer(js, cfg(), h)
	e.run(second)

	time.Sleep(200 * time.Millisecond)
	if err := stopFirst(); err != nil { // returns once the handler committed and acked
		t.Fatalf("Run: %v", err)
	}
	time.Sleep(1500 * time.Millisecond) // a redelivery after the last in-progress ack would show by now

	if n := e.effects(); n != 1 {
		t.Errorf("effects: %d, want 1", n)
	}
	d1, d2 := first.Stats().Duplicates.Load(), second.Stats().Duplicates.Load()
	if r := runs.Load(); r != 1 || d1 != 0 || d2 != 0 {
		t.Errorf("handler runs %d, duplicates %d and %d; want 1, 0 and 0", r, d1, d2)
	}
	if info := e.consumerInfo(testDurable); info.NumRedelivered != 0 || info.NumAckPending != 0 {
		t.Errorf("redelivered %d, ack pending %d; want 0 and 0", info.NumRedelivered, info.NumAckPending)
	}
}
