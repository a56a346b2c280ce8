package outbox_test

import (
	"context"
	"database/sql"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// gate holds a doorbell's notify until released, and counts the notifies started and done.
type gate struct {
	entered  chan struct{} // one value per notify started
	release  chan struct{} // closed to let the held notifies through
	started  atomic.Int32
	finished atomic.Int32
}

func newGate() *gate {
	return &gate{entered: make(chan struct{}, 16), release: make(chan struct{})}
}

func (g *gate) hold() {
	g.started.Add(1)
	g.entered <- struct{}{}
	<-g.release
}

// gatedPgx is a pgx handle whose Exec (the doorbell's notify) passes the gate.
type gatedPgx struct {
	txoutbox.DBTX
	g *gate
}

func (h gatedPgx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	h.g.hold()
	defer h.g.finished.Add(1)
	return h.DBTX.Exec(ctx, sql, args...)
}

// gatedSQL is a database/sql handle whose ExecContext (the doorbell's notify) passes the gate.
type gatedSQL struct {
	txoutbox.SQLDBTX
	g *gate
}

func (h gatedSQL) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	h.g.hold()
	defer h.g.finished.Add(1)
	return h.SQLDBTX.ExecContext(ctx, query, args...)
}

// PostgresDoorbell.Close, for the pgx and the database/sql doorbell against a real
// PostgreSQL: Close waits for the notify in flight (which is delivered), and a ring after
// Close sends nothing.
func TestPostgresDoorbellClose(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db := testsvc.NewDB(t)
	for _, tc := range []struct {
		name string
		bell func(g *gate, channel string) *outbox.PostgresDoorbell
	}{
		{"pgx", func(g *gate, channel string) *outbox.PostgresDoorbell {
			return outbox.NewPostgresDoorbell(gatedPgx{db.Pool, g}, channel)
		}},
		{"database/sql", func(g *gate, channel string) *outbox.PostgresDoorbell {
			return outbox.NewPostgresSQLDoorbell(gatedSQL{openSQL(t, db, "pgx"), g}, channel)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			channel := "doorbell_close_" + map[string]string{"pgx": "pgx", "database/sql": "sql"}[tc.name]
			listener, err := pgx.Connect(ctx, db.DSN)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = listener.Close(context.Background()) }()
			if _, err := listener.Exec(ctx, "LISTEN "+channel); err != nil {
				t.Fatal(err)
			}
			g := newGate()
			bell := tc.bell(g, channel)
			closing := outbox.DoorbellClosing(bell)

			// A notify in flight, held at the gate; Close starts meanwhile.
			bell.Ring()
			testsvc.Receive(t, g.entered, 10*time.Second, "the doorbell's notify")
			closed := make(chan int32, 1)
			go func() {
				bell.Close()
				closed <- g.finished.Load() // the notifies done when Close returned
			}()
			testsvc.Receive(t, closing, 10*time.Second, "Close to refuse later rings")
			bell.Ring() // after Close began: dropped
			close(g.release)
			if n := testsvc.Receive(t, closed, 10*time.Second, "Close to return"); n != 1 {
				t.Fatalf("Close returned with %d notifies done, want the one in flight done", n)
			}
			n, err := listener.WaitForNotification(ctx)
			if err != nil || n.Channel != channel || n.Payload != "" {
				t.Fatalf("the notify Close waited for: %+v, %v", n, err)
			}

			// Rings after Close send nothing: on this doorbell and on one closed while idle,
			// no notify reaches the handle, and the next notification on the channel is a
			// marker sent after them.
			idleGate := newGate()
			close(idleGate.release)
			idle := tc.bell(idleGate, channel)
			idle.Close()
			for _, b := range []*outbox.PostgresDoorbell{bell, idle} {
				b.Ring()
				b.Ring()
				b.Close() // waits for any send a ring could have started
			}
			if s := g.started.Load(); s != 1 {
				t.Fatalf("%d notifies started, want only the one before Close", s)
			}
			if s := idleGate.started.Load(); s != 0 {
				t.Fatalf("a doorbell closed while idle started %d notifies, want none", s)
			}
			if _, err := db.Pool.Exec(ctx, "SELECT pg_notify($1, 'marker')", channel); err != nil {
				t.Fatal(err)
			}
			n, err = listener.WaitForNotification(ctx)
			if err != nil || n.Payload != "marker" {
				t.Fatalf("after Close, the channel got %+v (%v), want only the marker", n, err)
			}
		})
	}
}
