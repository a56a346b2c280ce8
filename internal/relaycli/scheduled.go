package relaycli

import (
	"context"
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/status"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
)

func init() {
	register(command{name: "scheduled", summary: "list or cancel delayed messages waiting for their delivery time (list | cancel)", run: scheduledCmd})
}

const scheduledUsage = `
relay scheduled: delayed messages (outbox.Message.DeliverAt) that wait for their delivery time.
A relay publishes each within its poll interval of that time; until then it can be cancelled.

Usage:
  relay scheduled list [--subject S] [--due-within D] [--limit N] [--json]
                                               in due order, first due first; --limit 1 to
                                               100000; --due-within more than 0 (omit it for any)
  relay scheduled cancel MESSAGE_ID...         withdraw them (each in its own transaction)
  relay scheduled cancel --biz-key KEY         withdraw every scheduled message of a business key

A message that is no longer scheduled (it fell due and a relay took it, or was published, or
never existed) is not cancelled: cancel says so and exits with status 1. Only --database-url and
--schema are read from the environment: what to select or change is always typed. A setting
the action would ignore is refused (--subject, --due-within and --limit go with list only,
--biz-key with cancel), as are an empty --subject or --biz-key. --json prints a JSON array
(list) or a JSON object (what cancel did, as relay dead requeue and relay prepared commit:
{"action", "message_ids", "failed"}; a failed business key has a null message_id).
`

func scheduledCmd(ctx context.Context, env *Env, args []string) error {
	var dsn, schema, subject, bizKey string
	var within time.Duration
	var limit int
	var asJSON bool
	s := newSettings("scheduled", scheduledUsage, env.Stderr, env.Getenv)
	s.String(&dsn, "database-url", "DATABASE_URL", "", "PostgreSQL connection URL (required)")
	s.String(&schema, "schema", "", txoutbox.DefaultSchema, "Postgres schema holding the outbox tables")
	s.String(&subject, "subject", "", "", "list: only messages of this subject (exact)")
	s.Duration(&within, "due-within", "", 0, "list: only messages due within this long from now (more than 0; omit it for any)")
	helpDefault(s, "due-within", "any")
	s.Int(&limit, "limit", "", 100, "list: messages at most, first due first (1 to 100000)")
	s.String(&bizKey, "biz-key", "", "", "cancel: every scheduled message of this business key (Txoutbox-Biz-Key)")
	s.Bool(&asJSON, "json", "", false, "print JSON (list: an array; cancel: an object)")
	s.EnvironmentOnlyFor("database-url", "schema")
	if len(args) == 0 || (args[0] != "list" && args[0] != "cancel") {
		if len(args) > 0 && (args[0] == "--help" || args[0] == "-h") {
			s.printHelp(env.Stdout)
			return errHelp
		}
		return usageErr("want list or cancel (see relay scheduled --help)")
	}
	action := args[0]
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
		ids = append(ids, id)
	}
	// A setting the action would ignore is refused, naming it: cancel --subject would cancel
	// the business key's messages of every subject.
	typed := typedSettings(s)
	if err := refuseIgnored(s, typed, action, map[string][]string{
		"subject": {"list"}, "due-within": {"list"}, "limit": {"list"}, "biz-key": {"cancel"},
	}); err != nil {
		return err
	}
	switch {
	case typed["subject"] && subject == "":
		return usageErr("invalid --subject \"\": empty; omit --subject for every subject")
	case typed["biz-key"] && bizKey == "":
		return usageErr("invalid --biz-key \"\": empty; give the business key to cancel")
	}
	switch action {
	case "list":
		if err := checkLimit(limit); err != nil {
			return err
		}
		if typed["due-within"] && within <= 0 {
			// 0 was read as "any"; taken literally it would list only the overdue ones. Refused:
			// a 0 neither widens the list nor narrows it silently.
			return usageErr("invalid --due-within %v: must be more than 0; omit --due-within for every scheduled message", within)
		}
		if subject != "" {
			// An exact subject: a wildcard or a subject no producer could have written would
			// only ever list nothing.
			if outbox.ValidateSubjectFilter(subject) == nil && outbox.ValidateSubject(subject) != nil {
				return usageErr("invalid --subject %q: list takes an exact subject, not a wildcard", subject)
			}
			if err := outbox.ValidateSubject(subject); err != nil {
				return usageErr("invalid --subject: %v", err)
			}
		}
	case "cancel":
		if (len(ids) > 0) == (bizKey != "") {
			return usageErr("cancel takes message ids, or --biz-key")
		}
		if bizKey != "" {
			if err := outbox.ValidateKey(bizKey); err != nil {
				return usageErr("invalid --biz-key: %v", err)
			}
		}
	}
	if _, err := migrations.New(&migrations.Config{Schema: schema}); err != nil {
		return usageErr("invalid --schema: %v", err)
	}
	log, _ := newLogger(env.Stderr, "text", "warn")
	c, err := connect(ctx, connectOptions{DSN: dsn, Schema: schema, Log: log, AppName: "txoutbox-scheduled"})
	if err != nil {
		return err
	}
	defer c.Close()
	if err := checkSchema(ctx, c.Pool, schema); err != nil {
		return err
	}
	q := store.New(schema)

	if action == "list" {
		var before *time.Time
		if within > 0 {
			// On the database's clock, as the relay compares delivery times.
			var now time.Time
			if err := c.Pool.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
				return err
			}
			b := now.Add(within)
			before = &b
		}
		// One row more than shown says whether there are more.
		rows, err := q.ListScheduled(ctx, c.Pool, subject, before, limit+1)
		if err != nil {
			return err
		}
		more := len(rows) > limit
		rows = rows[:min(len(rows), limit)]
		if asJSON {
			out := make([]scheduledRowJSON, 0, len(rows))
			for _, r := range rows {
				// The list reads scheduled rows only.
				row := listRow{MessageID: r.MessageID, State: store.StateScheduled, Subject: r.Subject, Key: r.Key, Attempts: r.Attempts,
					CreatedAt: r.CreatedAt, LastError: r.LastError, PayloadBytes: r.PayloadBytes, Headers: r.Headers}
				row.noNilHeaders()
				out = append(out, scheduledRowJSON{listRow: row, BizKey: r.BizKey, DeliverAt: r.DeliverAt, DueAt: r.DueAt})
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
		// DUE counts from the due time, as the status page's overdue does (a delivery time
		// already past when the message was committed is due from the commit).
		fmt.Fprintln(tw, "MESSAGE ID\tSUBJECT\tKEY\tBIZ KEY\tDUE\tDELIVER AT\tBYTES")
		now := time.Now()
		for _, r := range rows {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\n", r.MessageID, cell(r.Subject, 0), cell(r.Key, 0), cell(r.BizKey, 60),
				status.Until(r.DueAt, now), r.DeliverAt.UTC().Format(time.RFC3339Nano), r.PayloadBytes)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		if len(rows) == 0 {
			fmt.Fprintln(env.Stdout, "(no scheduled messages)")
		}
		if more {
			writeMore(env.Stdout, limit)
		}
		return nil
	}

	res := changeResult{Action: action}
	if bizKey != "" {
		// The producer's own call: the cancel, and the key's latest state when none was
		// scheduled (a *outbox.ScheduleError).
		client, err := outbox.NewClient(&outbox.Config{Schema: schema})
		if err != nil {
			return err
		}
		var got []uuid.UUID
		err = pgx.BeginFunc(ctx, c.Pool, func(tx pgx.Tx) error {
			var err error
			got, err = client.CancelBizKeyTx(ctx, tx, bizKey)
			return err
		})
		var se *outbox.ScheduleError
		switch {
		case errors.As(err, &se) && se.State == "":
			res.Failed = append(res.Failed, changeFailure{Reason: fmt.Sprintf("business key %q: no message has it (never enqueued, or published and deleted)", bizKey)})
		case errors.As(err, &se):
			res.Failed = append(res.Failed, changeFailure{Reason: fmt.Sprintf("business key %q: none is scheduled: its latest message is %s", bizKey, se.State)})
		case err != nil:
			return fmt.Errorf("cancel business key %q: %w", bizKey, err)
		default:
			res.MessageIDs = append(res.MessageIDs, got...)
		}
	}
	seen := map[uuid.UUID]bool{}
	for _, id := range ids {
		if seen[id] {
			continue // given twice: one cancel, one answer
		}
		seen[id] = true
		var ok bool
		var st string
		err := pgx.BeginFunc(ctx, c.Pool, func(tx pgx.Tx) error {
			var err error
			ok, st, err = q.CancelScheduled(ctx, tx, id)
			return err
		})
		switch {
		case errors.Is(err, store.ErrNoRow):
			res.fail(id, reasonNoSuchMessage)
		case err != nil:
			return fmt.Errorf("cancel %s: %w", id, err)
		case !ok:
			res.fail(id, "not scheduled: it is "+st)
		default:
			res.MessageIDs = append(res.MessageIDs, id)
		}
	}
	return res.write(env, asJSON, "cancelled", "cancelled", "not cancelled")
}

// scheduledRowJSON is one element of relay scheduled list --json: the common list row, then
// the delayed message's own fields.
type scheduledRowJSON struct {
	listRow
	BizKey    string    `json:"biz_key"`
	DeliverAt time.Time `json:"deliver_at"`
	DueAt     time.Time `json:"due_at"`
}
