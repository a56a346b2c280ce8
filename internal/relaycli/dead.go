package relaycli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/txoutbox/txoutbox"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/migrations"
)

func init() {
	register(command{name: "dead", summary: "list, requeue or purge dead rows (list | requeue | purge)", run: deadCmd})
}

const deadUsage = `
relay dead: the rows whose publishing failed --max-attempts times. A dead row is never
dropped silently, and it holds back the later messages of its key until it is requeued or
purged.

Usage:
  relay dead list [filters]                   list dead rows (oldest first)
  relay dead requeue [filters | --all]        make them ready again: attempts 0, error cleared,
                                              due now; they go out before the rest of their key
  relay dead purge [filters | --all]          delete them for good; the later messages of their
                                              keys are then published

Filters combine (AND): --subject (NATS wildcards allowed: orders.*, orders.>), --older-than /
--newer-than (age since enqueue), --id (message ids, comma-separated). requeue and purge need
a filter or --all, and take --dry-run.
`

func deadCmd(ctx context.Context, env *Env, args []string) error {
	var dsn, schema, subject, ids string
	var olderThan, newerThan time.Duration
	var limit int
	var all, dryRun, asJSON bool
	s := newSettings("dead", deadUsage, env.Stderr, env.Getenv)
	s.String(&dsn, "database-url", "DATABASE_URL", "", "PostgreSQL connection URL (required)")
	s.String(&schema, "schema", "", txoutbox.DefaultSchema, "Postgres schema holding the outbox tables")
	s.String(&subject, "subject", "", "", "only rows of this subject (NATS wildcards * and > allowed)")
	s.Duration(&olderThan, "older-than", "", 0, "only rows enqueued at least this long ago")
	s.Duration(&newerThan, "newer-than", "", 0, "only rows enqueued at most this long ago")
	s.String(&ids, "id", "", "", "only these message ids (comma-separated UUIDs)")
	s.Int(&limit, "limit", "", 0, "at most this many rows (list: default 100; requeue, purge: default all that match)")
	s.Bool(&all, "all", "", false, "requeue, purge: every dead row (required when no filter is given)")
	s.Bool(&dryRun, "dry-run", "", false, "requeue, purge: say what would change, change nothing")
	s.Bool(&asJSON, "json", "", false, "print JSON")
	s.CommandLineOnly("subject", "older-than", "newer-than", "id", "limit", "all", "dry-run", "json")
	if len(args) == 0 || (args[0] != "list" && args[0] != "requeue" && args[0] != "purge") {
		if len(args) > 0 && (args[0] == "--help" || args[0] == "-h") {
			s.printHelp(env.Stdout)
			return errHelp
		}
		return usageErr("want list, requeue or purge (see relay dead --help)")
	}
	action := args[0]
	if err := parseSettings(s, env, args[1:]); err != nil {
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
	f := store.DeadFilter{Subject: subject, OlderThan: olderThan, NewerThan: newerThan, Limit: limit}
	if olderThan < 0 || newerThan < 0 || limit < 0 {
		return usageErr("--older-than, --newer-than and --limit must not be negative")
	}
	if subject != "" {
		if _, err := store.SubjectRegexp(subject); err != nil {
			return usageErr("invalid --subject: %v", err)
		}
	}
	for _, x := range strings.Split(ids, ",") {
		if x = strings.TrimSpace(x); x == "" {
			continue
		}
		id, err := uuid.Parse(x)
		if err != nil {
			return usageErr("invalid --id %q: %v", x, err)
		}
		f.IDs = append(f.IDs, id)
	}
	filtered := subject != "" || olderThan > 0 || newerThan > 0 || len(f.IDs) > 0
	switch {
	case action == "list" && limit == 0:
		f.Limit = 100
	case action != "list" && !filtered && !all:
		return usageErr("%s changes every dead row without a filter: give --subject, --older-than, --newer-than or --id, or --all", action)
	case action != "list" && filtered && all:
		return usageErr("--all and filters exclude each other")
	}

	log, _ := newLogger(env.Stderr, "text", "warn")
	c, err := connect(ctx, connectOptions{DSN: dsn, Schema: schema, Log: log, AppName: "txoutbox-dead"})
	if err != nil {
		return err
	}
	defer c.Close()
	if err := checkSchema(ctx, c.Pool, schema); err != nil {
		return err
	}
	q := store.New(schema)

	if action == "list" {
		rows, err := q.ListDead(ctx, c.Pool, f)
		if err != nil {
			return err
		}
		if asJSON {
			if rows == nil {
				rows = []store.DeadRow{}
			}
			return writeJSON(env, rows)
		}
		tw := tabwriter.NewWriter(env.Stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "MESSAGE ID\tSUBJECT\tKEY\tATTEMPTS\tENQUEUED\tLAST ERROR")
		for _, r := range rows {
			key := r.Key
			if key == "" {
				key = "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", r.MessageID, r.Subject, key, r.Attempts,
				r.CreatedAt.Local().Format("2006-01-02 15:04:05"), oneLine(r.LastError, 80))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		fmt.Fprintf(env.Stdout, "%d dead rows listed", len(rows))
		if len(rows) == f.Limit {
			fmt.Fprintf(env.Stdout, " (the first %d; raise --limit for more)", f.Limit)
		}
		fmt.Fprintln(env.Stdout)
		return nil
	}

	var changed []uuid.UUID
	err = pgx.BeginFunc(ctx, c.Pool, func(tx pgx.Tx) error {
		var err error
		if action == "requeue" {
			changed, err = q.RequeueDead(ctx, tx, f)
		} else {
			changed, err = q.PurgeDead(ctx, tx, f)
		}
		if err == nil && dryRun {
			return errDryRun
		}
		return err
	})
	if err != nil && !errors.Is(err, errDryRun) {
		return err
	}
	verb := map[string]string{"requeue": "requeued", "purge": "purged"}[action]
	if dryRun {
		verb = "would be " + verb
	}
	if asJSON {
		if changed == nil {
			changed = []uuid.UUID{}
		}
		return writeJSON(env, map[string]any{"action": action, "dry_run": dryRun, "message_ids": changed})
	}
	for _, id := range changed {
		fmt.Fprintf(env.Stdout, "%s %s\n", verb, id)
	}
	fmt.Fprintf(env.Stdout, "%d dead rows %s\n", len(changed), verb)
	return nil
}

var errDryRun = errors.New("dry run")

func writeJSON(env *Env, v any) error {
	enc := json.NewEncoder(env.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// oneLine flattens s to one line of at most n runes.
func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}
