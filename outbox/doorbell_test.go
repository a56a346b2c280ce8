package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
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

// The doorbell constructors refuse what would panic later (a nil handle: on Ring, or in the
// Postgres doorbell's goroutine, killing the process), what contradicts the doorbell's rule
// (one transaction or connection, used from the doorbell's goroutine and possibly inside the
// business transaction), and a channel or subject the relay could never match. The refusal is
// a *txoutbox.ConfigError naming the argument, from Err and from NewClient; such a doorbell
// never rings.
func TestDoorbellConstructorsRefuseBadArguments(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none") // never connects
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	type bell interface {
		outbox.Doorbell
		Err() error
	}
	for _, tc := range []struct {
		name  string
		bell  bell
		field string
		want  error // a sentinel behind the ConfigError, or nil
	}{
		{"NATS nil conn", outbox.NewNATSDoorbell(nil, ""), "nc", nil},
		{"NATS wildcard subject", outbox.NewNATSDoorbell(new(nats.Conn), "txoutbox.*"), "subject", outbox.ErrInvalidSubject},
		{"pgx nil", outbox.NewPostgresDoorbell(nil, ""), "db", nil},
		{"pgx typed nil pool", outbox.NewPostgresDoorbell((*pgxpool.Pool)(nil), ""), "db", nil},
		{"pgx transaction", outbox.NewPostgresDoorbell(struct{ pgx.Tx }{}, ""), "db", nil},
		{"pgx connection", outbox.NewPostgresDoorbell(new(pgx.Conn), ""), "db", nil},
		{"pgx pool connection", outbox.NewPostgresDoorbell(new(pgxpool.Conn), ""), "db", nil},
		{"pgx channel of 64 bytes", outbox.NewPostgresDoorbell(pool, strings.Repeat("c", 64)), "channel", nil},
		{"pgx channel with NUL", outbox.NewPostgresDoorbell(pool, "a\x00b"), "channel", nil},
		{"pgx channel not UTF-8", outbox.NewPostgresDoorbell(pool, "a\xffb"), "channel", nil},
		{"sql nil", outbox.NewPostgresSQLDoorbell(nil, ""), "db", nil},
		{"sql typed nil DB", outbox.NewPostgresSQLDoorbell((*sql.DB)(nil), ""), "db", nil},
		{"sql transaction", outbox.NewPostgresSQLDoorbell(new(sql.Tx), ""), "db", nil},
		{"sql connection", outbox.NewPostgresSQLDoorbell(new(sql.Conn), ""), "db", nil},
		{"sql channel of 64 bytes", outbox.NewPostgresSQLDoorbell(new(sql.DB), strings.Repeat("c", 64)), "channel", nil},
	} {
		var ce *txoutbox.ConfigError
		err := tc.bell.Err()
		if !errors.As(err, &ce) || ce.Package != "outbox" || ce.Field != tc.field || !errors.Is(err, txoutbox.ErrInvalidConfig) ||
			(tc.want != nil && !errors.Is(err, tc.want)) {
			t.Errorf("%s: Err() = %v, want a *txoutbox.ConfigError naming %s", tc.name, err, tc.field)
			continue
		}
		tc.bell.Ring() // nothing: no panic, no goroutine
		_, err = outbox.NewClient(&outbox.Config{Doorbell: tc.bell})
		if !errors.As(err, &ce) || ce.Field != "Config.Doorbell" || !errors.Is(err, tc.bell.Err()) {
			t.Errorf("%s: NewClient = %v, want a *txoutbox.ConfigError for Config.Doorbell wrapping %v", tc.name, err, tc.bell.Err())
		}
	}
	// A nil pointer in the interface is refused too (Ring would panic on it).
	var ce *txoutbox.ConfigError
	if _, err := outbox.NewClient(&outbox.Config{Doorbell: (*outbox.NATSDoorbell)(nil)}); !errors.As(err, &ce) || ce.Field != "Config.Doorbell" {
		t.Errorf("NewClient with a nil *NATSDoorbell: %v, want a *txoutbox.ConfigError for Config.Doorbell", err)
	}
	// The good ones: the defaults, and a channel of exactly 63 bytes.
	for _, b := range []bell{outbox.NewNATSDoorbell(new(nats.Conn), ""), outbox.NewPostgresDoorbell(pool, ""),
		outbox.NewPostgresDoorbell(pool, strings.Repeat("c", outbox.MaxDoorbellChannelLength)), outbox.NewPostgresSQLDoorbell(new(sql.DB), "")} {
		if err := b.Err(); err != nil {
			t.Errorf("%T: %v", b, err)
		}
		if _, err := outbox.NewClient(&outbox.Config{Doorbell: b}); err != nil {
			t.Errorf("NewClient with a %T: %v", b, err)
		}
	}
}

// A channel of MaxDoorbellChannelLength bytes reaches a relay listening on it: the limit is
// PostgreSQL's, not shorter.
func TestPostgresDoorbellLongestChannel(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db := testsvc.NewDB(t)
	channel := strings.Repeat("d", outbox.MaxDoorbellChannelLength)
	listener, err := pgx.Connect(ctx, db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = listener.Close(context.Background()) }()
	if _, err := listener.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	bell := outbox.NewPostgresDoorbell(db.Pool, channel)
	if err := bell.Err(); err != nil {
		t.Fatal(err)
	}
	defer bell.Close()
	bell.Ring()
	if n, err := listener.WaitForNotification(ctx); err != nil || n.Channel != channel {
		t.Fatalf("notification %+v, %v; want one on the %d-byte channel", n, err, len(channel))
	}
}
