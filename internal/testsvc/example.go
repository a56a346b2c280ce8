package testsvc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"os"
	"testing"

	"github.com/txoutbox/txoutbox/internal/embedded"
)

// ExampleEnv prepares the environment of a package's runnable examples, whose code reads its
// settings as a service would, from DATABASE_URL, NATS_URL and TXOUTBOX_SCHEMA: DATABASE_URL is
// set to the PostgreSQL the tests use (starting a throwaway cluster if needed), TXOUTBOX_SCHEMA
// to a schema name of this run's own (dropped by stop), and NATS_URL to an embedded JetStream
// server that runs until stop. Call it from TestMain, before Main.
func ExampleEnv() (stop func(), err error) {
	dsn, err := postgresDSN()
	if err != nil {
		return nil, fmt.Errorf("testsvc: examples: PostgreSQL: %w", err)
	}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	schema := "example_" + hex.EncodeToString(rnd[:])
	if err := os.Setenv("TXOUTBOX_SCHEMA", schema); err != nil {
		return nil, err
	}
	dropSchema := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			return
		}
		defer conn.Close(ctx)
		_, _ = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}
	srv, err := embedded.StartNATS(embedded.NATSOptions{})
	if err != nil {
		return nil, fmt.Errorf("testsvc: examples: NATS: %w", err)
	}
	if err := os.Setenv("DATABASE_URL", dsn); err != nil {
		srv.Shutdown()
		return nil, err
	}
	if err := os.Setenv("NATS_URL", srv.URL()); err != nil {
		srv.Shutdown()
		return nil, err
	}
	return func() { srv.Shutdown(); dropSchema() }, nil
}

// ExampleMain is TestMain for a package with examples: ExampleEnv, then Main.
func ExampleMain(m *testing.M) int {
	stop, err := ExampleEnv()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer stop()
	return Main(m)
}
