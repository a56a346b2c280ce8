// Package testsvc gives tests real services: an isolated, migrated schema in a real
// PostgreSQL and a real JetStream (an embedded nats-server per test).
//
// PostgreSQL is found at TEST_DATABASE_URL, else DATABASE_URL, else 127.0.0.1:5432 (user
// postgres, database test); when none answers, a throwaway cluster is started from the local
// PostgreSQL binaries for the test binary's life. Packages using it call Main from TestMain so
// that the throwaway cluster is stopped at exit.
package testsvc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/migrations"
)

// DefaultLocalDSN is where tests look for PostgreSQL when no URL is set.
const DefaultLocalDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

var (
	pgOnce    sync.Once
	pgDSN     string
	pgErr     error
	pgCluster *embedded.Postgres
)

// Main runs the tests, then stops a throwaway PostgreSQL cluster if one was started and
// removes the relay binary if RelayBinary built one.
func Main(m *testing.M) int {
	code := m.Run()
	if relayDir != "" {
		_ = os.RemoveAll(relayDir)
	}
	if pgCluster != nil {
		pgCluster.Stop()
	}
	return code
}

// PostgresDSN returns the DSN of the PostgreSQL the tests use, starting a throwaway cluster if
// needed.
func PostgresDSN(tb testing.TB) string {
	tb.Helper()
	dsn, err := postgresDSN()
	if err != nil {
		tb.Fatalf("testsvc: PostgreSQL: %v", err)
	}
	return dsn
}

func postgresDSN() (string, error) {
	pgOnce.Do(func() {
		ctx := context.Background()
		for _, env := range []string{"TEST_DATABASE_URL", "DATABASE_URL"} {
			if v := os.Getenv(env); v != "" {
				pgDSN = v
				if err := embedded.Ping(ctx, v, 5*time.Second); err != nil {
					pgErr = fmt.Errorf("%s is set but PostgreSQL does not answer there: %w", env, err)
				}
				return
			}
		}
		if embedded.Ping(ctx, DefaultLocalDSN, 2*time.Second) == nil {
			pgDSN = DefaultLocalDSN
			return
		}
		fmt.Fprintln(os.Stderr, "testsvc: no PostgreSQL at TEST_DATABASE_URL, DATABASE_URL or 127.0.0.1:5432; starting a throwaway cluster")
		pgCluster, pgErr = embedded.StartPostgres(ctx, embedded.PostgresOptions{})
		if pgErr == nil {
			pgDSN = pgCluster.DSN()
		}
	})
	return pgDSN, pgErr
}

// DB is an isolated schema, migrated to the latest version.
type DB struct {
	// Schema is the test's own schema; pass it as Config.Schema.
	Schema string
	// Pool connects with search_path set to Schema, so unqualified business tables created by
	// the test land there too.
	Pool *pgxpool.Pool
	// DSN connects like Pool (search_path included).
	DSN string
	// AdminPool connects without the search_path, for pg_terminate_backend and the like.
	AdminPool *pgxpool.Pool
}

var nonIdent = regexp.MustCompile(`[^a-z0-9_]+`)

// NewDB creates a fresh schema for the test, migrates it, and drops it when the test ends.
func NewDB(tb testing.TB) *DB {
	tb.Helper()
	db, cleanup, err := openDB(context.Background(), PostgresDSN(tb), tb.Name())
	if err != nil {
		tb.Fatalf("testsvc: %v", err)
	}
	tb.Cleanup(func() {
		if err := cleanup(); err != nil {
			tb.Logf("testsvc: %v", err)
		}
	})
	return db
}

// OpenDB is NewDB for Example functions, which have no testing.TB: it returns the database
// and a cleanup function that drops the schema.
func OpenDB(ctx context.Context, name string) (*DB, func(), error) {
	dsn, err := postgresDSN()
	if err != nil {
		return nil, nil, err
	}
	db, cleanup, err := openDB(ctx, dsn, name)
	if err != nil {
		return nil, nil, err
	}
	return db, func() { _ = cleanup() }, nil
}

func openDB(ctx context.Context, base, name string) (*DB, func() error, error) {
	name = strings.ToLower(name)
	name = nonIdent.ReplaceAllString(name, "_")
	if len(name) > 40 {
		name = name[len(name)-40:]
	}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	schema := "t_" + strings.Trim(name, "_") + "_" + hex.EncodeToString(rnd[:])

	admin, err := pgxpool.New(ctx, base)
	if err != nil {
		return nil, nil, fmt.Errorf("connect: %w", err)
	}
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		admin.Close()
		return nil, nil, err
	}
	if _, err := m.Up(ctx, admin); err != nil {
		admin.Close()
		return nil, nil, fmt.Errorf("migrate %s: %w", schema, err)
	}
	dsn := WithSearchPath(base, schema)
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		admin.Close()
		return nil, nil, fmt.Errorf("connect: %w", err)
	}
	cleanup := func() error {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		defer admin.Close()
		if _, err := admin.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			return fmt.Errorf("drop schema %s: %w", schema, err)
		}
		return nil
	}
	return &DB{Schema: schema, Pool: pool, DSN: dsn, AdminPool: admin}, cleanup, nil
}

// WithSearchPath adds search_path=schema to a URL-style DSN.
func WithSearchPath(dsn, schema string) string {
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	return dsn + sep + "search_path=" + schema
}

// NATS is an embedded nats-server for one test, with a connection and a JetStream context.
type NATS struct {
	*embedded.NATS
	Conn *nats.Conn
	JS   jetstream.JetStream
}

// NewNATS starts a JetStream-enabled nats-server for the test and stops it when the test ends.
func NewNATS(tb testing.TB) *NATS {
	tb.Helper()
	srv, err := embedded.StartNATS(embedded.NATSOptions{StoreDir: tb.TempDir()})
	if err != nil {
		tb.Fatalf("testsvc: %v", err)
	}
	tb.Cleanup(srv.Shutdown)
	nc, err := Connect(srv.URL())
	if err != nil {
		tb.Fatalf("testsvc: connect to nats: %v", err)
	}
	tb.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatalf("testsvc: jetstream: %v", err)
	}
	return &NATS{NATS: srv, Conn: nc, JS: js}
}

// Connect connects the way a long-running service should: reconnect forever, quickly.
func Connect(url string) (*nats.Conn, error) {
	return nats.Connect(url,
		nats.MaxReconnects(-1),
		nats.ReconnectWait(50*time.Millisecond),
		nats.RetryOnFailedConnect(true),
	)
}

// Stream creates a file-storage stream with a two-minute duplicate window.
func (n *NATS) Stream(tb testing.TB, name string, subjects ...string) jetstream.Stream {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := n.JS.CreateStream(ctx, jetstream.StreamConfig{
		Name:       name,
		Subjects:   subjects,
		Storage:    jetstream.FileStorage,
		Duplicates: 2 * time.Minute,
	})
	if err != nil {
		tb.Fatalf("testsvc: create stream %s: %v", name, err)
	}
	return s
}

// StreamMsgs returns every message of a stream, in stream order.
func StreamMsgs(tb testing.TB, js jetstream.JetStream, stream string) []*jetstream.RawStreamMsg {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// A JetStream API request can go unanswered while a cluster's stream leader changes (the
	// request reaches the leader that just stepped down): ask again, 5 s an attempt, until
	// the 30 s are up.
	// The same for a JetStream that answers "temporarily unavailable" (503) or not at all
	// while a restarted node catches up.
	var s jetstream.Stream
	var info *jetstream.StreamInfo
	err := retryTransient(ctx, func(actx context.Context) (err error) {
		if s, err = js.Stream(actx, stream); err == nil {
			info, err = s.Info(actx)
		}
		return err
	})
	if err != nil {
		tb.Fatalf("testsvc: stream %s: %v", stream, err)
	}
	var out []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		var m *jetstream.RawStreamMsg
		err := retryTransient(ctx, func(actx context.Context) (err error) {
			m, err = s.GetMsg(actx, seq)
			return err
		})
		if err != nil {
			tb.Fatalf("testsvc: get %s/%d: %v", stream, seq, err)
		}
		out = append(out, m)
	}
	return out
}

// retryTransient calls f with a context of 5 s an attempt until it succeeds, fails with an
// error that is not transient, or ctx ends. Transient: no answer in time, no responders, or
// JetStream's 503 ("temporarily unavailable", a cluster electing or catching up).
func retryTransient(ctx context.Context, f func(context.Context) error) error {
	for wait := 10 * time.Millisecond; ; wait = min(2*wait, 500*time.Millisecond) {
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := f(actx)
		cancel()
		var apiErr *jetstream.APIError
		transient := errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrNoResponders) ||
			errors.Is(err, jetstream.ErrNoStreamResponse) || errors.As(err, &apiErr) && apiErr.Code == 503
		if err == nil || !transient || ctx.Err() != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(wait):
		}
	}
}
