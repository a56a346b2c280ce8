package relaycli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/migrations"
)

func init() {
	register(command{name: "dead", summary: "list, show, requeue or purge dead rows (list | show | requeue | purge)", run: deadCmd})
}

const deadUsage = `
relay dead: the rows whose publishing failed --max-attempts times. A dead row is never
dropped silently, and it holds back the later messages of its key until it is requeued or
purged.

Usage:
  relay dead list [filters]                   list dead rows (oldest first)
  relay dead show MESSAGE_ID                  one dead row: headers, payload (text when it is
                                              UTF-8 text, else base64) and last error
  relay dead requeue [filters | --all]        make them ready again: attempts 0, error cleared,
                                              due now; they go out before the rest of their key
  relay dead purge [filters | --all]          delete them for good; the later messages of their
                                              keys are then published

Filters combine (AND): --subject (NATS wildcards allowed: orders.*, orders.>), --older-than /
--newer-than (age since enqueue), --id (message ids, comma-separated). requeue and purge need
a filter or --all, and take --dry-run. --limit N (1 to 100000) bounds the rows listed (100
unless given) or changed (every row that matches unless given). A 0 is literal or refused:
--older-than 0 matches every row (so requeue and purge do not take it as their filter),
--newer-than 0 and --limit 0 are refused; so are an empty --subject or --id, arguments (ids go
in --id), and a setting the action would ignore (--all and --dry-run go with requeue and purge
only; show takes no filter). Only --database-url and --schema are read from the environment:
what to select or change is always typed. --json prints a JSON array (list), a JSON object
(show, and what requeue and purge did).
`

func deadCmd(ctx context.Context, env *Env, args []string) error {
	var dsn, schema, subject, ids string
	var olderThan, newerThan time.Duration
	var limit int
	var all, dryRun, asJSON bool
	s := newSettings("dead", deadUsage, env.Stderr, env.Getenv)
	s.String(&dsn, "database-url", "DATABASE_URL", "", "PostgreSQL connection URL (required)")
	s.String(&schema, "schema", "", txoutbox.DefaultSchema, "Postgres schema holding the outbox tables")
	s.String(&subject, "subject", "", "", "only rows of this subject (NATS wildcards * and > allowed; '>' alone is no filter for requeue and purge)")
	s.Duration(&olderThan, "older-than", "", 0, "only rows enqueued at least this long ago (0: every row)")
	helpDefault(s, "older-than", "any age")
	s.Duration(&newerThan, "newer-than", "", 0, "only rows enqueued at most this long ago (more than 0)")
	helpDefault(s, "newer-than", "any age")
	s.String(&ids, "id", "", "", "only these message ids (comma-separated UUIDs)")
	s.Int(&limit, "limit", "", 0, "at most this many rows, 1 to 100000")
	helpDefault(s, "limit", "100 for list, every row that matches for requeue and purge")
	s.Bool(&all, "all", "", false, "requeue, purge: every dead row (required when no filter is given)")
	s.Bool(&dryRun, "dry-run", "", false, "requeue, purge: say what would change, change nothing")
	s.Bool(&asJSON, "json", "", false, "print JSON")
	s.EnvironmentOnlyFor("database-url", "schema")
	if len(args) == 0 || (args[0] != "list" && args[0] != "show" && args[0] != "requeue" && args[0] != "purge") {
		if len(args) > 0 && (args[0] == "--help" || args[0] == "-h") {
			s.printHelp(env.Stdout)
			return errHelp
		}
		return usageErr("want list, show, requeue or purge (see relay dead --help)")
	}
	action := args[0]
	positional, err := parseInterleaved(s, env, args[1:])
	if err != nil {
		return err
	}
	var showID uuid.UUID
	switch {
	case action == "show" && len(positional) != 1:
		return usageErr("show takes one message id")
	case action == "show":
		if showID, err = uuid.Parse(positional[0]); err != nil {
			return usageErr("invalid message id %q: %v", positional[0], err)
		}
	case action == "list" && len(positional) > 0:
		return usageErr("list takes no arguments (got %q)", positional)
	case len(positional) > 0:
		return usageErr("%s takes no arguments (got %q): give message ids with --id", action, positional)
	}
	if dsn == "" {
		return usageErr("no database: set DATABASE_URL or --database-url")
	}
	if err := migrations.ValidateSchemaName(schema); err != nil {
		return usageErr("invalid --schema: %v", err)
	}
	// A setting the action would ignore is refused, naming it.
	typed := typedSettings(s)
	if action == "show" {
		for _, name := range s.order {
			if typed[name] && name != "database-url" && name != "schema" && name != "json" {
				return usageErr("show takes a message id and no filters (got --%s)", name)
			}
		}
	}
	if err := refuseIgnored(s, typed, action, map[string][]string{
		"all": {"requeue", "purge"}, "dry-run": {"requeue", "purge"},
	}); err != nil {
		return err
	}
	// Every 0 (and every empty filter) is literal or refused, never read as "any": none makes
	// a selection wider than what was typed.
	f := store.DeadFilter{Subject: subject, OlderThan: olderThan, NewerThan: newerThan}
	switch {
	case typed["subject"] && subject == "":
		return usageErr("invalid --subject \"\": empty; omit --subject for every subject")
	case typed["newer-than"] && newerThan == 0:
		return usageErr("invalid --newer-than 0: no row was enqueued less than 0 ago; omit --newer-than for any age")
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
	changes := action == "requeue" || action == "purge"
	if typed["id"] && len(f.IDs) == 0 {
		return usageErr("invalid --id %q: no message id; omit --id for every message id", ids)
	}
	switch {
	case typed["limit"] && changes && (limit < 1 || limit > maxAdminLimit):
		return usageErr("invalid --limit %d: must be between 1 and %d; omit --limit to %s every row that matches", limit, maxAdminLimit, action)
	case typed["limit"]:
		if err := checkLimit(limit); err != nil {
			return err
		}
	case action == "list":
		limit = 100
	}
	f.Limit = limit // requeue and purge without --limit: 0, every row that matches
	if action == "list" {
		f.Limit = limit + 1 // one row more than shown says whether there are more
	}
	// --older-than 0 is literal (every row was enqueued at least 0 ago): it narrows nothing.
	// A subject of ">" alone matches every subject: no narrowing, like --older-than 0.
	narrowed := (subject != "" && subject != ">") || olderThan > 0 || newerThan > 0 || len(f.IDs) > 0
	filterTyped := ""
	for _, name := range []string{"subject", "older-than", "newer-than", "id"} {
		if typed[name] && filterTyped == "" {
			filterTyped = name
		}
	}
	switch {
	case changes && all && filterTyped != "":
		return usageErr("--all and filters exclude each other (got --all and --%s)", filterTyped)
	case changes && !all && !narrowed && subject == ">":
		return usageErr("%s with --subject '>' changes every dead row (it matches every subject): give a filter that narrows it, or --all", action)
	case changes && !all && !narrowed && typed["older-than"]:
		return usageErr("%s with --older-than 0 changes every dead row (each was enqueued at least 0 ago): give a filter that narrows it, or --all", action)
	case changes && !all && !narrowed:
		return usageErr("%s changes every dead row without a filter: give --subject, --older-than, --newer-than or --id, or --all", action)
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

	if action == "show" {
		return showMessage(ctx, env, c.Pool, q, showID, []string{store.StateDead}, "dead", asJSON)
	}
	if action == "list" {
		rows, err := q.ListDead(ctx, c.Pool, f)
		if err != nil {
			return err
		}
		more := len(rows) > limit
		rows = rows[:min(len(rows), limit)]
		if asJSON {
			out := make([]deadRowJSON, 0, len(rows))
			for _, r := range rows {
				out = append(out, newDeadRowJSON(r))
			}
			if err := writeJSON(env, out); err != nil {
				return err
			}
			if more {
				writeMore(env.Stderr, limit)
			}
			return nil
		}
		tw := tabwriter.NewWriter(env.Stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "MESSAGE ID\tSUBJECT\tKEY\tATTEMPTS\tENQUEUED\tLAST ERROR")
		for _, r := range rows {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", r.MessageID, cell(r.Subject, 0), cell(r.Key, 0), r.Attempts,
				r.CreatedAt.Local().Format("2006-01-02 15:04:05"), cell(r.LastError, 80))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		fmt.Fprintf(env.Stdout, "%d %s listed", len(rows), plural(len(rows), "dead row", "dead rows"))
		if more {
			fmt.Fprintf(env.Stdout, " (the first %d; raise --limit for more)", limit)
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
	// Every id asked for by name (--id) that was not changed is a failure, with why: a typo,
	// the wrong schema, a row no longer dead (requeued already) must not read as done.
	res := changeResult{Action: action, DryRun: &dryRun, MessageIDs: changed}
	for _, id := range unchanged(f.IDs, changed) {
		why, err := whyUnchanged(ctx, c.Pool, q, id, []string{store.StateDead}, "dead")
		if err != nil {
			return err
		}
		res.fail(id, why)
	}
	verb := map[string]string{"requeue": "requeued", "purge": "purged"}[action]
	notVerb := "not " + verb
	if dryRun {
		verb, notVerb = "would be "+verb, "would not be "+verb
	}
	return res.write(env, asJSON, verb, plural(len(res.MessageIDs), "dead row", "dead rows")+" "+verb, notVerb)
}

var errDryRun = errors.New("dry run")

// deadRowJSON is one element of relay dead list --json: the common list row.
type deadRowJSON = listRow

func newDeadRowJSON(r store.DeadRow) deadRowJSON {
	row := listRow{MessageID: r.MessageID, State: store.StateDead, Subject: r.Subject, Key: r.Key, Attempts: r.Attempts,
		CreatedAt: r.CreatedAt, LastError: r.LastError, PayloadBytes: int64(r.PayloadBytes), Headers: r.Headers}
	row.noNilHeaders()
	return row
}

func writeJSON(env *Env, v any) error {
	enc := json.NewEncoder(env.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
