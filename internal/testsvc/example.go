package testsvc

import (
	"fmt"
	"os"
	"testing"

	"github.com/txoutbox/txoutbox/internal/embedded"
)

// ExampleEnv prepares the environment of a package's runnable examples, whose code reads its
// services as a service would, from DATABASE_URL and NATS_URL: DATABASE_URL is set to the
// PostgreSQL the tests use (starting a throwaway cluster if needed) and NATS_URL to an
// embedded JetStream server that runs until stop. Call it from TestMain, before Main.
func ExampleEnv() (stop func(), err error) {
	dsn, err := postgresDSN()
	if err != nil {
		return nil, fmt.Errorf("testsvc: examples: PostgreSQL: %w", err)
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
	return srv.Shutdown, nil
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
