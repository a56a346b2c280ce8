package relaycli

import (
	"context"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/status"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/relay"
)

func init() {
	register(command{name: "status", summary: "show the backlog per subject, dead and prepared rows, relays and partitions", run: statusCmd})
}

const statusUsage = `
relay status: a snapshot of the outbox — ready backlog per subject with the oldest ready age,
dead and prepared rows, the relays and the partitions each holds (from pg_locks), and anything
that needs attention. Read-only.

Usage:
  relay status [settings]
`

func statusCmd(ctx context.Context, env *Env, args []string) error {
	var dsn, schema string
	var partitions int
	var asJSON bool
	s := newSettings("status", statusUsage, env.Stderr, env.Getenv)
	s.String(&dsn, "database-url", "DATABASE_URL", "", "PostgreSQL connection URL (required)")
	s.String(&schema, "schema", "", txoutbox.DefaultSchema, "Postgres schema holding the outbox tables")
	s.Int(&partitions, "partitions", "", relay.DefaultPartitions, "partition count to group the backlog by when no relay is running (otherwise the relays' count)")
	s.Bool(&asJSON, "json", "", false, "print JSON instead of tables")
	s.CommandLineOnly("json")
	if err := parseSettings(s, env, args); err != nil {
		return err
	}
	if len(s.Args()) > 0 {
		return usageErr("unexpected arguments %q", s.Args())
	}
	if dsn == "" {
		return usageErr("no database: set DATABASE_URL or --database-url")
	}
	if err := migrations.ValidateSchemaName(schema); err != nil {
		return usageErr("invalid --schema: %v", err)
	}
	if partitions < 1 {
		return usageErr("invalid --partitions %d: must be at least 1", partitions)
	}
	log, _ := newLogger(env.Stderr, "text", "warn")
	c, err := connect(ctx, connectOptions{DSN: dsn, Schema: schema, Log: log, AppName: "txoutbox-status"})
	if err != nil {
		return err
	}
	defer c.Close()
	if err := checkSchema(ctx, c.Pool, schema); err != nil {
		return err
	}
	snap, err := status.Collect(ctx, c.Pool, store.New(schema), &status.Options{Partitions: partitions})
	if err != nil {
		return err
	}
	if asJSON {
		return writeJSON(env, snap)
	}
	return status.WriteText(env.Stdout, snap)
}
