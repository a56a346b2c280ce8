package txoutbox_test

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

func TestMain(m *testing.M) { os.Exit(testsvc.Main(m)) }

// Every component refuses a second Run while one is running (txoutbox.ErrRunning), and runs
// again once it has returned.
func TestRunRefusesASecondRunWhileRunning(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	n.Stream(t, "RUN", "run.>")
	n.Stream(t, "RUN_DEAD", "txoutbox.dead.>")
	r, err := relay.New(db.Pool, n.JS, &relay.Config{Schema: db.Schema, LeaseInterval: 50 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(db.Pool, n.JS, func(context.Context, pgx.Tx, consumer.Message) error { return nil },
		&consumer.Config{Stream: "RUN", Durable: "run", Schema: db.Schema, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	cb, err := checkback.New(db.Pool, n.Conn, &checkback.Config{Schema: db.Schema, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	for _, comp := range []struct {
		name string
		run  func(context.Context) error
	}{{"relay", r.Run}, {"consumer", c.Run}, {"checkback", cb.Run}} {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		start := func() { go func() { done <- comp.run(ctx) }() }
		start()
		// A second Run, on a cancelled context, is refused once the first holds the component;
		// if the second got there first, the first is refused instead and starts again.
		stopped, stop := context.WithCancel(context.Background())
		stop()
		testsvc.Eventually(t, 10*time.Second, comp.name+": a second Run refused", func() bool {
			select {
			case err := <-done:
				if !errors.Is(err, txoutbox.ErrRunning) {
					t.Fatalf("%s: the first Run returned: %v", comp.name, err)
				}
				start()
				return false
			default:
			}
			return errors.Is(comp.run(stopped), txoutbox.ErrRunning)
		})
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Fatalf("%s: Run: %v", comp.name, err)
		}
		if err := comp.run(stopped); errors.Is(err, txoutbox.ErrRunning) {
			t.Fatalf("%s: Run after the first returned: %v", comp.name, err)
		}
	}
}

// Two components of one kind on one Prometheus registry share their collectors: neither New
// fails (two relays in one process, a consumer restarted, two check-backs).
func TestComponentsShareARegistry(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	reg := prometheus.NewRegistry()
	for i := range 2 {
		r, err := relay.New(db.Pool, n.JS, &relay.Config{Schema: db.Schema, Registerer: reg, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatalf("relay %d: %v", i+1, err)
		}
		r.Close()
		if _, err := checkback.New(db.Pool, n.Conn, &checkback.Config{Schema: db.Schema, Registerer: reg}); err != nil {
			t.Fatalf("check-back %d: %v", i+1, err)
		}
		if _, err := consumer.New(db.Pool, n.JS, func(context.Context, pgx.Tx, consumer.Message) error { return nil },
			&consumer.Config{Stream: "S", Durable: "d", Schema: db.Schema, Registerer: reg}); err != nil {
			t.Fatalf("consumer %d: %v", i+1, err)
		}
		if _, err := outbox.NewClient(&outbox.Config{Schema: db.Schema, Registerer: reg}); err != nil {
			t.Fatalf("outbox client %d: %v", i+1, err)
		}
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, mf := range mfs {
		seen[strings.SplitN(mf.GetName(), "_", 3)[1]] = true
	}
	for _, sub := range []string{"relay", "checkback", "consumer", "outbox"} {
		if !seen[sub] {
			t.Errorf("no txoutbox_%s_* metric registered", sub)
		}
	}
}
