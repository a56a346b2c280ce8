package relaycli

import (
	"context"
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
	if w := p.find("embedded mode: starting a throwaway PostgreSQL cluster (deleted at exit, with everything in it); set --database-url to keep data"); len(w) != 1 || w[0].Fields["level"] != "WARN" {
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
