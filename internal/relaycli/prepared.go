package relaycli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"slices"
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
	register(command{name: "prepared", summary: "list, show, resume, commit or roll back half messages (list | show | resume | commit | rollback)", run: preparedCmd})
}

const preparedUsage = `
relay prepared: inspect and settle half messages that wait for an answer: prepared (the
check-back will ask) or check_exhausted (the check-back gave up; nothing happens to them until
an operator acts).

Usage:
  relay prepared list [--state S] [--group G] [--limit N] [--json]
                                                               oldest first; --limit 1 to 100000
  relay prepared show MESSAGE_ID [--json]                      one half message: headers, payload (text
                                                               when it is UTF-8 text, else base64), last error
  relay prepared resume (MESSAGE_ID... | --all [--group G])   check_exhausted -> prepared, checks start over
  relay prepared commit MESSAGE_ID...                          publish them (prepared or check_exhausted)
  relay prepared rollback MESSAGE_ID...                        drop them (prepared or check_exhausted)

Only --database-url and --schema are read from the environment: what to select or change is
always typed. A setting the action would ignore is refused (--state and --limit go with list
only, --group with list and resume --all, --all with resume), as are arguments to list and an
empty --group. --json prints a JSON array (list) or a JSON object (show, and what resume,
commit and rollback did: {"action", "message_ids", "failed"}).
`

func preparedCmd(ctx context.Context, env *Env, args []string) error {
	var dsn, schema, state, group string
	var limit int
	var asJSON, all bool
	s := newSettings("prepared", preparedUsage, env.Stderr, env.Getenv)
	s.String(&dsn, "database-url", "DATABASE_URL", "", "PostgreSQL connection URL (required)")
	s.String(&schema, "schema", "", txoutbox.DefaultSchema, "Postgres schema holding the outbox tables")
	s.String(&state, "state", "", "all", "list: prepared, check_exhausted or all (both)")
	s.String(&group, "group", "", "", "list, resume --all: only this producer group")
	s.Int(&limit, "limit", "", 100, "list: rows at most, oldest first (1 to 100000)")
	s.Bool(&asJSON, "json", "", false, "print JSON (list: an array; show: an object; resume, commit, rollback: what changed, an object)")
	s.Bool(&all, "all", "", false, "resume: every check_exhausted message (of --group, if given)")
	s.EnvironmentOnlyFor("database-url", "schema")
	if len(args) == 0 || (args[0] != "list" && args[0] != "show" && args[0] != "resume" && args[0] != "commit" && args[0] != "rollback") {
		if len(args) > 0 && (args[0] == "--help" || args[0] == "-h") {
			s.printHelp(env.Stdout)
			return errHelp
		}
		return usageErr("want list, show, resume, commit or rollback (see relay prepared --help)")
	}
	action := args[0]
	// Settings may come before, between or after the message ids.
	positional, err := parseInterleaved(s, env, args[1:])
	if err != nil {
		return err
	}
	if dsn == "" {
		return usageErr("no database: set DATABASE_URL or --database-url")
	}
	if action == "list" && len(positional) > 0 {
		return usageErr("list takes no arguments (got %q)", positional)
	}
	var ids []uuid.UUID
	for _, a := range positional {
		id, err := uuid.Parse(a)
		if err != nil {
			return usageErr("invalid message id %q: %v", a, err)
		}
		if !slices.Contains(ids, id) { // given twice: one change, one answer
			ids = append(ids, id)
		}
	}
	// Selection settings another action would ignore are refused, naming them.
	typed := typedSettings(s)
	if err := refuseIgnored(s, typed, action, map[string][]string{
		"state": {"list"}, "limit": {"list"}, "group": {"list", "resume"}, "all": {"resume"},
	}); err != nil {
		return err
	}
	if typed["group"] && group == "" {
		return usageErr("invalid --group \"\": empty; omit --group for every group")
	}
	var states []string
	switch action {
	case "list":
		switch state {
		case "all":
			states = store.SettleableStates
		case store.StatePrepared, store.StateCheckExhausted:
			states = []string{state}
		default:
			return usageErr("invalid --state %q: want prepared, check_exhausted or all", state)
		}
		if err := checkLimit(limit); err != nil {
			return err
		}
	case "show":
		if len(ids) != 1 {
			return usageErr("show takes one message id")
		}
	case "resume":
		if all == (len(ids) > 0) {
			return usageErr("resume takes message ids, or --all")
		}
		if group != "" && !all {
			return usageErr("--group goes with --all: resume by id resumes those messages whatever their group")
		}
	default:
		if len(ids) == 0 {
			return usageErr("%s takes one or more message ids", action)
		}
	}
	if _, err := migrations.New(&migrations.Config{Schema: schema}); err != nil {
		return usageErr("invalid --schema: %v", err)
	}
	log, _ := newLogger(env.Stderr, "text", "warn")
	c, err := connect(ctx, connectOptions{DSN: dsn, Schema: schema, Log: log, AppName: "txoutbox-prepared"})
	if err != nil {
		return err
	}
	defer c.Close()
	if err := checkSchema(ctx, c.Pool, schema); err != nil {
		return err
	}
	q := store.New(schema)

	switch action {
	case "show":
		return showMessage(ctx, env, c.Pool, q, ids[0], store.SettleableStates, "prepared or check_exhausted", asJSON)
	case "list":
		// One row more than shown says whether there are more.
		rows, err := q.ListHalf(ctx, c.Pool, states, group, limit+1)
		if err != nil {
			return err
		}
		more := len(rows) > limit
		rows = rows[:min(len(rows), limit)]
		if asJSON {
			out := make([]preparedRow, 0, len(rows))
			for _, r := range rows {
				row, err := preparedJSON(r)
				if err != nil {
					return err
				}
				out = append(out, row)
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
		fmt.Fprintln(tw, "MESSAGE ID\tSTATE\tGROUP\tMODE\tSUBJECT\tKEY\tCHECKS\tAGE\tNEXT CHECK\tLAST ERROR")
		now := time.Now()
		for _, r := range rows {
			next := "-"
			if r.NextCheckAt != nil {
				next = "in " + r.NextCheckAt.Sub(now).Round(time.Second).String()
				if r.NextCheckAt.Before(now) {
					next = "due"
				}
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", r.MessageID, r.State, cell(r.Group, 0), cell(r.Mode, 0),
				cell(r.Subject, 0), cell(r.Key, 0), r.CheckCount, now.Sub(r.CreatedAt).Round(time.Second), next, cell(r.LastError, 80))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		if len(rows) == 0 {
			fmt.Fprintln(env.Stdout, noHalfMessages(states, group))
		}
		if more {
			writeMore(env.Stdout, limit)
		}
		return nil
	case "resume":
		done, err := q.Resume(ctx, c.Pool, ids, all, group)
		if err != nil {
			return err
		}
		res := changeResult{Action: action, MessageIDs: done}
		for _, id := range unchanged(ids, done) {
			why, err := whyUnchanged(ctx, c.Pool, q, id, []string{store.StateCheckExhausted}, "check_exhausted")
			if err != nil {
				return err
			}
			res.fail(id, why)
		}
		return res.write(env, asJSON, "resumed", "resumed", "not resumed")
	}

	commit := action == "commit"
	res := changeResult{Action: action}
	for _, id := range ids {
		var ok bool
		var st string
		err := pgx.BeginFunc(ctx, c.Pool, func(tx pgx.Tx) error {
			var err error
			ok, st, err = q.SettleHalf(ctx, tx, store.HalfSettle{MessageID: id, Commit: commit, By: store.SettledByOperator})
			return err
		})
		switch {
		case errors.Is(err, store.ErrNoRow):
			res.fail(id, reasonNoSuchMessage)
		case err != nil:
			return fmt.Errorf("%s %s: %w", action, id, err)
		case !ok:
			res.fail(id, "not prepared or check_exhausted: it is "+st)
		default:
			res.MessageIDs = append(res.MessageIDs, id)
		}
	}
	if commit {
		return res.write(env, asJSON, "committed", "committed", "not committed")
	}
	return res.write(env, asJSON, "rolled back", "rolled back", "not rolled back")
}

// maxAdminLimit bounds --limit of relay dead, prepared and scheduled: a list is printed at
// once, a requeue or purge is one transaction.
const maxAdminLimit = 100_000

// checkLimit refuses a --limit outside 1..maxAdminLimit: 0 is no number of rows to show or
// change, never the default or "all".
func checkLimit(limit int) error {
	if limit < 1 || limit > maxAdminLimit {
		return usageErr("invalid --limit %d: must be between 1 and %d", limit, maxAdminLimit)
	}
	return nil
}

// typedSettings returns the names of the settings given on the command line. The admin
// commands read only --database-url and --schema from the environment (EnvironmentOnlyFor):
// any other name it holds was typed, whatever its value.
func typedSettings(s *settings) map[string]bool {
	typed := map[string]bool{}
	s.fs.Visit(func(f *flag.Flag) { typed[f.Name] = true })
	return typed
}

// refuseIgnored refuses (a usage error, exit 2) the first setting typed that action would
// ignore, naming it: uses maps a setting to the actions that read it; a setting it does not
// name goes with every action.
func refuseIgnored(s *settings, typed map[string]bool, action string, uses map[string][]string) error {
	for _, name := range s.order {
		actions, ok := uses[name]
		if !typed[name] || !ok || slices.Contains(actions, action) {
			continue
		}
		with := strings.Join(actions, ", ")
		if n := len(actions); n > 1 {
			with = strings.Join(actions[:n-1], ", ") + " and " + actions[n-1]
		}
		return usageErr("--%s goes with %s only: %s would ignore it", name, with, action)
	}
	return nil
}

// helpDefault sets what --help says a setting's default is, for a setting whose absence means
// what no value of it does (no bound, or a default that depends on the action).
func helpDefault(s *settings, name, text string) {
	s.fs.Lookup(name).DefValue = text
}

// preparedRow is one element of relay prepared list --json: the common list row, then the
// half message's own fields.
type preparedRow struct {
	listRow
	Group       string     `json:"group"`
	Mode        string     `json:"mode"`
	Checks      int32      `json:"checks"`
	NextCheckAt *time.Time `json:"next_check_at"`
}

// preparedJSON is r as a row of relay prepared list --json.
func preparedJSON(r store.HalfRow) (preparedRow, error) {
	row := listRow{MessageID: r.MessageID, State: r.State, Subject: r.Subject, Key: r.Key, Attempts: r.Attempts,
		CreatedAt: r.CreatedAt, LastError: r.LastError, PayloadBytes: r.PayloadBytes}
	if len(r.Headers) > 0 {
		var h store.HeaderMap // never fails: odd headers are shown, not refused
		if err := json.Unmarshal(r.Headers, &h); err != nil {
			return preparedRow{}, fmt.Errorf("message %s: its stored headers: %w", r.MessageID, err)
		}
		row.Headers = h
	}
	row.noNilHeaders()
	return preparedRow{listRow: row, Group: r.Group, Mode: r.Mode, Checks: r.CheckCount, NextCheckAt: r.NextCheckAt}, nil
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// noHalfMessages is what prepared list prints under its header when no row matches: the
// states (and the group) it looked for, as scheduled list says "(no scheduled messages)".
func noHalfMessages(states []string, group string) string {
	s := "(no " + strings.Join(states, " or ") + " messages"
	if group != "" {
		s += " of group " + cell(group, 0)
	}
	return s + ")"
}
