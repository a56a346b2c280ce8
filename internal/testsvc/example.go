package testsvc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/embedded"
)

// defaultSchemaEnv, set in the environment of a test binary, makes ExampleEnv leave
// TXOUTBOX_SCHEMA unset and point DATABASE_URL at a throwaway database of its own, so that the
// examples run as a service with no schema setting would: in the default schema, public, of a
// database no other test shares.
const defaultSchemaEnv = "TXOUTBOX_TESTSVC_EXAMPLES_DEFAULT_SCHEMA"

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
	if os.Getenv(defaultSchemaEnv) != "" {
		return exampleEnvDefaultSchema(dsn)
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

// exampleEnvDefaultSchema is ExampleEnv for RunExamplesInDefaultSchema's child: a throwaway
// database (dropped by stop), TXOUTBOX_SCHEMA unset.
func exampleEnvDefaultSchema(adminDSN string) (stop func(), err error) {
	u, err := url.Parse(adminDSN)
	if err != nil || u.Scheme == "" {
		return nil, fmt.Errorf("testsvc: examples: the PostgreSQL DSN is not a URL: %q", adminDSN)
	}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	name := "txoutbox_examples_" + hex.EncodeToString(rnd[:])
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, adminDSN)
	if err != nil {
		return nil, fmt.Errorf("testsvc: examples: %w", err)
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return nil, fmt.Errorf("testsvc: examples: create database %s: %w", name, err)
	}
	dropDB := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, adminDSN)
		if err != nil {
			fmt.Fprintf(os.Stderr, "testsvc: examples: drop database %s: %v\n", name, err)
			return
		}
		defer func() { _ = conn.Close(ctx) }()
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			fmt.Fprintf(os.Stderr, "testsvc: examples: drop database %s: %v\n", name, err)
		}
	}
	u.Path = "/" + name
	srv, err := embedded.StartNATS(embedded.NATSOptions{})
	if err != nil {
		dropDB()
		return nil, fmt.Errorf("testsvc: examples: NATS: %w", err)
	}
	stop = func() { srv.Shutdown(); dropDB() }
	for k, v := range map[string]string{"DATABASE_URL": u.String(), "NATS_URL": srv.URL()} {
		if err := os.Setenv(k, v); err != nil {
			stop()
			return nil, err
		}
	}
	if err := os.Unsetenv("TXOUTBOX_SCHEMA"); err != nil {
		stop()
		return nil, err
	}
	return stop, nil
}

var examplePassed = regexp.MustCompile(`(?m)^--- PASS: (Example\w*)`)

// RunExamplesInDefaultSchema runs the package's Example functions again, in a child process of
// the test binary whose ExampleEnv (from ExampleMain) leaves TXOUTBOX_SCHEMA unset and gives
// them a throwaway database: the examples' code must work with the default schema, as a
// service's does when the variable is not set. It fails the test unless every example passes,
// and returns the names of those that ran.
func RunExamplesInDefaultSchema(t *testing.T) []string {
	t.Helper()
	if os.Getenv(defaultSchemaEnv) != "" {
		t.Skip("the child run of the examples")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^Example", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), defaultSchemaEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the examples with TXOUTBOX_SCHEMA unset: %v\n%s", err, out)
	}
	var ran []string
	for _, m := range examplePassed.FindAllStringSubmatch(string(out), -1) {
		ran = append(ran, m[1])
	}
	slices.Sort(ran)
	want, err := runnableExamples(".")
	if err != nil {
		t.Fatal(err)
	}
	if len(want) == 0 || !slices.Equal(ran, want) {
		t.Fatalf("with TXOUTBOX_SCHEMA unset, the examples that passed are %v; the package's runnable examples are %v:\n%s", ran, want, out)
	}
	return ran
}

// runnableExamples lists the Example functions of the test files in dir that go test runs
// (those with an output comment), sorted.
func runnableExamples(dir string) ([]string, error) {
	fset := token.NewFileSet()
	matches, err := filepath.Glob(filepath.Join(dir, "*_test.go"))
	if err != nil {
		return nil, err
	}
	var files []*ast.File
	for _, name := range matches {
		f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	var names []string
	for _, ex := range doc.Examples(files...) {
		if ex.Output != "" || ex.EmptyOutput {
			names = append(names, "Example"+ex.Name)
		}
	}
	slices.Sort(names)
	return names, nil
}
