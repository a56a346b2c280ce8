package relaycli

import (
	"context"
	"fmt"
	"text/tabwriter"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/migrations"
)

func init() {
	register(command{name: "migrate", summary: "apply, revert, list or export schema migrations, print least-privilege grants (up | down | status | export | grants)", run: migrateCmd})
}

const migrateUsage = `
relay migrate: manage the outbox schema with the embedded migrations (the same files as
migrations/*.sql, which deploy tools such as golang-migrate can apply as they are).

Usage:
  relay migrate up [settings]          apply every pending migration
  relay migrate down [settings]        revert the newest migration (--steps N, or --all)
  relay migrate status [settings]      list migrations and whether each is applied
  relay migrate export --dir D [--format golang-migrate|goose]
                                       write the migration files for another tool (no database);
                                       again after an upgrade: writes the new ones, leaves the rest
  relay migrate grants --role producer|relay|consumer|admin [--schema S]
                                       print the SQL of a least-privilege role (no database)
`

func migrateCmd(ctx context.Context, env *Env, args []string) error {
	if len(args) > 0 && args[0] == "grants" {
		return grantsCmd(ctx, env, args[1:])
	}
	var dsn, schema string
	var steps int
	var all bool
	var dir, format string
	s := newSettings("migrate", migrateUsage, env.Stderr, env.Getenv)
	s.String(&dsn, "database-url", "DATABASE_URL", "", "PostgreSQL connection URL (required)")
	s.String(&schema, "schema", "", txoutbox.DefaultSchema, "Postgres schema holding the outbox tables (created by up)")
	s.Int(&steps, "steps", "", 1, "down: how many migrations to revert")
	s.Bool(&all, "all", "", false, "down: revert every migration")
	s.String(&dir, "dir", "", "", "export: directory to write the files into")
	s.String(&format, "format", "", migrations.FormatGolangMigrate, "export: golang-migrate (NNN_name.up/down.sql) or goose (NNN_name.sql with annotations)")
	// What to revert or write is never read from the environment: a stray TXOUTBOX_ALL must
	// not drop the outbox.
	s.CommandLineOnly("steps", "all", "dir", "format")
	if len(args) == 0 || (args[0] != "up" && args[0] != "down" && args[0] != "status" && args[0] != "export") {
		if len(args) > 0 && (args[0] == "--help" || args[0] == "-h") {
			s.printHelp(env.Stdout)
			return errHelp
		}
		return usageErr("want up, down, status, export or grants (see relay migrate --help)")
	}
	action := args[0]
	if err := parseSettings(s, env, args[1:]); err != nil {
		return err
	}
	// A setting the action would ignore is refused, naming it: down --steps 2 --all reverted
	// every migration.
	typed := typedSettings(s)
	if err := refuseIgnored(s, typed, action, map[string][]string{
		"steps": {"down"}, "all": {"down"}, "dir": {"export"}, "format": {"export"},
	}); err != nil {
		return err
	}
	if all && typed["steps"] {
		return usageErr("--steps and --all together: revert --steps N migrations, or --all of them, not both")
	}
	if action == "export" {
		if dir == "" {
			return usageErr("export needs --dir")
		}
		if format != migrations.FormatGolangMigrate && format != migrations.FormatGoose {
			return usageErr("invalid --format %q: want %s or %s", format, migrations.FormatGolangMigrate, migrations.FormatGoose)
		}
		written, err := migrations.Export(dir, format)
		for _, p := range written {
			fmt.Fprintln(env.Stdout, "wrote", p)
		}
		if err == nil && len(written) == 0 {
			fmt.Fprintln(env.Stdout, dir, "already holds every migration: nothing written")
		}
		return err
	}
	if dsn == "" {
		return usageErr("no database: set DATABASE_URL or --database-url")
	}
	if steps < 1 {
		return usageErr("invalid --steps %d: must be at least 1", steps)
	}
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		return usageErr("invalid --schema: %v", err)
	}
	log, _ := newLogger(env.Stderr, "text", "warn")
	c, err := connect(ctx, connectOptions{DSN: dsn, Schema: schema, Log: log, AppName: "txoutbox-migrate"})
	if err != nil {
		return err
	}
	defer c.Close()
	switch action {
	case "up":
		done, err := m.Up(ctx, c.Pool)
		for _, v := range done {
			fmt.Fprintf(env.Stdout, "applied %03d_%s\n", v, m.Migrations()[v-1].Name)
		}
		if err != nil {
			return err
		}
		if len(done) == 0 {
			fmt.Fprintf(env.Stdout, "schema %q is up to date (version %d)\n", schema, m.Latest())
		}
	case "down":
		n := steps
		if all {
			n = migrations.DownAll
		}
		done, err := m.Down(ctx, c.Pool, n)
		for _, v := range done {
			fmt.Fprintf(env.Stdout, "reverted %03d_%s\n", v, m.Migrations()[v-1].Name)
		}
		if err != nil {
			return err
		}
		if len(done) == 0 {
			fmt.Fprintf(env.Stdout, "schema %q has no migration applied\n", schema)
		}
	case "status":
		st, err := m.Status(ctx, c.Pool)
		if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(env.Stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "VERSION\tNAME\tAPPLIED")
		for _, x := range st {
			at := "no"
			switch {
			case x.Applied && x.AppliedAt.IsZero():
				at = "yes"
			case x.Applied:
				at = x.AppliedAt.Format("2006-01-02 15:04:05 MST")
			}
			fmt.Fprintf(tw, "%03d\t%s\t%s\n", x.Version, x.Name, at)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		if len(st) > 0 && st[0].Source != "" && st[0].Source != migrations.VersionTable {
			fmt.Fprintf(env.Stdout, "versions read from %s\n", st[0].Source)
		}
	}
	return nil
}
