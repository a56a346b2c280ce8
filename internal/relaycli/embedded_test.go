package relaycli

import (
	"context"
	"io"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/embedded"
)

// `relay run --embedded` never writes into a database nobody named: not even into the
// PostgreSQL that runs on 127.0.0.1:5432. It starts a throwaway cluster and says so.
func TestEmbeddedUsesAThrowawayCluster(t *testing.T) {
	t.Parallel()
	if _, err := embedded.FindPostgresBinaries(); err != nil {
		t.Skip(err)
	}
	schema := "t_embedded_" + randomSuffix()
	p := startRelay(t, "relay-embedded", "run", "--embedded", "--schema", schema, "--log-format", "json", "--no-checkback")
	p.waitLog(t, "relay started", 60*time.Second)
	if w := p.find("embedded mode: starting a throwaway PostgreSQL cluster (deleted at exit, with everything in it); set --database-url and --nats-url, without --embedded, to keep data"); len(w) != 1 || w[0].Fields["level"] != "WARN" {
		t.Errorf("embedded mode did not say loudly where its tables are:\n%s", p.output())
	}
	local := "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	ctx := context.Background()
	if conn, err := pgx.Connect(ctx, local); err != nil {
		t.Logf("no PostgreSQL on 127.0.0.1:5432 (%v): nothing there to check", err)
	} else {
		defer conn.Close(ctx)
		var n int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_namespace WHERE nspname = $1`, schema).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			_, _ = conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
			t.Errorf("relay run --embedded created schema %s in the database postgres on 127.0.0.1:5432", schema)
		}
	}
	if code := p.stop(t, syscall.SIGTERM); code != 0 {
		t.Errorf("exit %d after SIGTERM, want 0", code)
	}
}

// --embedded is a development convenience: typed on the command line, never inherited from
// the environment, and never combined with a named database and no NATS, which would publish
// that database's outbox into a throwaway server and lose its messages at exit.
func TestEmbeddedNeverTakesANamedDatabasesMessages(t *testing.T) {
	t.Parallel()
	run := func(env map[string]string, args ...string) (int, string) {
		var errb strings.Builder
		code := Main(context.Background(), args, &Env{Stdout: io.Discard, Stderr: &errb, Getenv: func(k string) string { return env[k] }})
		return code, errb.String()
	}
	// A stray TXOUTBOX_EMBEDDED is not read: with no database named, run refuses to start.
	if code, stderr := run(map[string]string{"TXOUTBOX_EMBEDDED": "true"}, "run", "--schema", "t_embedded_env"); code != 2 ||
		!strings.Contains(stderr, "no database: set DATABASE_URL (or --database-url), or pass --embedded") {
		t.Errorf("TXOUTBOX_EMBEDDED=true, no database: exit %d, %q; want exit 2, no database (the variable is not read)", code, stderr)
	}
	want := "--embedded with a database named (DATABASE_URL or --database-url) and no NATS: its outbox would be published into a throwaway"
	for _, c := range []struct {
		env  map[string]string
		args []string
	}{
		{nil, []string{"run", "--embedded", "--database-url", "postgres://app@127.0.0.1:1/orders"}},
		{map[string]string{"DATABASE_URL": "postgres://app@127.0.0.1:1/orders"}, []string{"run", "--embedded"}},
	} {
		if code, stderr := run(c.env, c.args...); code != 2 || !strings.Contains(stderr, want) {
			t.Errorf("%v %v: exit %d, %q; want exit 2 saying %q", c.env, c.args, code, stderr, want)
		}
	}
}
