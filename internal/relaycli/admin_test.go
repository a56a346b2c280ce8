package relaycli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/status"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

func TestMain(m *testing.M) { os.Exit(testsvc.Main(m)) }

// cli runs the relay command in-process and returns its exit status, stdout and stderr.
func cli(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := Main(context.Background(), args, &Env{Stdout: &out, Stderr: &errb, Getenv: func(string) string { return "" }})
	return code, out.String(), errb.String()
}

type adminEnv struct {
	t   *testing.T
	db  *testsvc.DB
	ids map[string]uuid.UUID
}

// newAdminEnv enqueues rows over three subjects and kills some of them:
// orders.created: 3 ready; orders.paid: 2 ready + 2 dead (one old); audit.log: 1 dead.
func newAdminEnv(t *testing.T) *adminEnv {
	t.Helper()
	db := testsvc.NewDB(t)
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	e := &adminEnv{t: t, db: db, ids: map[string]uuid.UUID{}}
	names := []string{"c1", "c2", "c3", "p1", "p2", "pdead-old", "pdead-new", "adead"}
	subjects := []string{"orders.created", "orders.created", "orders.created", "orders.paid", "orders.paid", "orders.paid", "orders.paid", "audit.log"}
	var msgs []outbox.Message
	for i, n := range names {
		msgs = append(msgs, outbox.Message{Subject: subjects[i], Key: n, Payload: []byte(n)})
	}
	ctx := context.Background()
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		ids, err := c.EnqueueTx(ctx, tx, msgs...)
		for i, id := range ids {
			e.ids[names[i]] = id
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	e.exec(`UPDATE txoutbox_messages SET state = 'dead', attempts = 20, last_error = 'nats: no responders available for request'
		WHERE message_id = ANY($1)`, []uuid.UUID{e.ids["pdead-old"], e.ids["pdead-new"], e.ids["adead"]})
	e.exec(`UPDATE txoutbox_messages SET created_at = now() - interval '3 hours' WHERE message_id = $1`, e.ids["pdead-old"])
	return e
}

func (e *adminEnv) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.db.Pool.Exec(context.Background(), sql, args...); err != nil {
		e.t.Fatal(err)
	}
}

func (e *adminEnv) row(name string) (state string, attempts int, lastErr *string, found bool) {
	e.t.Helper()
	err := e.db.Pool.QueryRow(context.Background(), `SELECT state, attempts, last_error FROM txoutbox_messages WHERE message_id = $1`, e.ids[name]).
		Scan(&state, &attempts, &lastErr)
	if err == pgx.ErrNoRows {
		return "", 0, nil, false
	}
	if err != nil {
		e.t.Fatal(err)
	}
	return state, attempts, lastErr, true
}

func (e *adminEnv) args(cmd ...string) []string {
	return append(cmd, "--database-url", e.db.DSN, "--schema", e.db.Schema)
}

func TestStatusCommand(t *testing.T) {
	t.Parallel()
	e := newAdminEnv(t)
	code, out, errOut := cli(t, e.args("status")...)
	if code != 0 {
		t.Fatalf("relay status = %d: %s", code, errOut)
	}
	t.Logf("relay status:\n%s", out)
	for _, want := range []string{
		"5 ready (5 due, 0 retrying)", "3 dead",
		"SUBJECT", "orders.created", "orders.paid", "audit.log",
		"PARTITION", "0/8", "7/8",
		"(no relay is running)",
		"no relay is running and 5 rows wait to be published",
		"3 dead rows hold back their keys",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("relay status output lacks %q", want)
		}
	}
	// The per-subject line of orders.paid: 2 ready, 2 dead.
	var paid string
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "orders.paid ") {
			paid = strings.Join(strings.Fields(l), " ")
		}
	}
	if !strings.HasPrefix(paid, "orders.paid 2 2 0 ") || !strings.HasSuffix(paid, " 2 0 0") {
		t.Errorf("orders.paid line = %q, want 2 ready, 2 due, 0 retrying, ..., 2 dead, 0 prepared, 0 exhausted", paid)
	}

	code, out, errOut = cli(t, e.args("status", "--json", "--partitions", "4")...)
	if code != 0 {
		t.Fatalf("relay status --json = %d: %s", code, errOut)
	}
	var snap status.Snapshot
	if err := json.Unmarshal([]byte(out), &snap); err != nil {
		t.Fatalf("status --json is not JSON: %v\n%s", err, out)
	}
	if snap.Totals.Ready != 5 || snap.Totals.Dead != 3 || len(snap.Subjects) != 3 || snap.Partitions != 4 || len(snap.Partition) != 4 {
		t.Fatalf("status --json = %+v", snap)
	}
	var sum int64
	for _, p := range snap.Partition {
		sum += p.Ready
		if p.Holder != "" {
			t.Fatalf("partition %d has holder %q with no relay running", p.Partition, p.Holder)
		}
	}
	if sum != 5 {
		t.Fatalf("partition backlog adds up to %d, want 5", sum)
	}
}

func TestDeadCommands(t *testing.T) {
	t.Parallel()
	e := newAdminEnv(t)

	// list, with each filter.
	code, out, errOut := cli(t, e.args("dead", "list")...)
	if code != 0 || !strings.Contains(out, "3 dead rows listed") || !strings.Contains(out, "no responders") {
		t.Fatalf("dead list = %d\n%s%s", code, out, errOut)
	}
	t.Logf("relay dead list:\n%s", out)
	listIDs := func(args ...string) []uuid.UUID {
		t.Helper()
		code, out, errOut := cli(t, e.args(append([]string{"dead", "list", "--json"}, args...)...)...)
		if code != 0 {
			t.Fatalf("dead list %v = %d: %s", args, code, errOut)
		}
		var rows []struct {
			MessageID uuid.UUID `json:"message_id"`
			Attempts  int       `json:"attempts"`
		}
		if err := json.Unmarshal([]byte(out), &rows); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		var ids []uuid.UUID
		for _, r := range rows {
			ids = append(ids, r.MessageID)
		}
		return ids
	}
	same := func(got []uuid.UUID, names ...string) bool {
		if len(got) != len(names) {
			return false
		}
		for i, n := range names {
			if got[i] != e.ids[n] {
				return false
			}
		}
		return true
	}
	for _, c := range []struct {
		args []string
		want []string
	}{
		{[]string{"--subject", "orders.paid"}, []string{"pdead-old", "pdead-new"}},
		{[]string{"--subject", "orders.*"}, []string{"pdead-old", "pdead-new"}},
		{[]string{"--subject", ">"}, []string{"pdead-old", "pdead-new", "adead"}},
		{[]string{"--subject", "audit.>"}, []string{"adead"}},
		{[]string{"--subject", "orders"}, nil},
		{[]string{"--older-than", "1h"}, []string{"pdead-old"}},
		{[]string{"--newer-than", "1h"}, []string{"pdead-new", "adead"}},
		{[]string{"--id", e.ids["adead"].String() + "," + e.ids["c1"].String()}, []string{"adead"}},
		{[]string{"--limit", "1"}, []string{"pdead-old"}},
		// Literal: every row was enqueued at least 0 ago.
		{[]string{"--older-than", "0"}, []string{"pdead-old", "pdead-new", "adead"}},
		{[]string{"--subject", "orders.paid", "--older-than", "0s"}, []string{"pdead-old", "pdead-new"}},
	} {
		if got := listIDs(c.args...); !same(got, c.want...) {
			t.Errorf("dead list %v = %v, want %v", c.args, got, c.want)
		}
	}
	// "More" is said when there are more rows, not when exactly --limit came back.
	for _, c := range []struct {
		args []string
		more bool
	}{{[]string{"--limit", "2"}, true}, {[]string{"--limit", "3"}, false}, {[]string{"--limit", "4"}, false}, {nil, false}} {
		code, out, errOut := cli(t, e.args(append([]string{"dead", "list"}, c.args...)...)...)
		if code != 0 || strings.Contains(out, "raise --limit for more") != c.more {
			t.Errorf("dead list %v of 3 dead rows: exit %d, %s%s; want the \"more\" note %v", c.args, code, out, errOut, c.more)
		}
		if c.more && !strings.Contains(out, "2 dead rows listed (the first 2; raise --limit for more)") {
			t.Errorf("dead list %v: %s", c.args, out)
		}
	}

	// Bad usage exits 2 and changes nothing. No 0, empty value or ignored setting makes
	// requeue or purge select more than typed (--limit 0 was "all", --newer-than 0 "any age").
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"purge"}, "purge changes every dead row without a filter"},
		{[]string{"requeue"}, "requeue changes every dead row without a filter"},
		{[]string{"purge", "--all", "--subject", "x"}, "--all and filters exclude each other (got --all and --subject)"},
		{[]string{"list", "--subject", "a..b"}, "invalid --subject"},
		{[]string{"list", "--id", "not-a-uuid"}, `invalid --id "not-a-uuid"`},
		{[]string{"frobnicate"}, "want list, show, requeue or purge"},
		{[]string{"purge", "--subject", "orders.paid", "--limit", "0"}, "invalid --limit 0: must be between 1 and 100000; omit --limit to purge every row that matches"},
		{[]string{"requeue", "--all", "--limit", "-1"}, "invalid --limit -1: must be between 1 and 100000; omit --limit to requeue every row that matches"},
		{[]string{"purge", "--all", "--limit", "100001"}, "invalid --limit 100001"},
		{[]string{"purge", "--subject", "orders.paid", "--newer-than", "0"}, "invalid --newer-than 0: no row was enqueued less than 0 ago; omit --newer-than for any age"},
		{[]string{"purge", "--older-than", "0"}, "purge with --older-than 0 changes every dead row (each was enqueued at least 0 ago): give a filter that narrows it, or --all"},
		{[]string{"purge", "--subject", ">"}, "purge with --subject '>' changes every dead row (it matches every subject): give a filter that narrows it, or --all"},
		{[]string{"requeue", "--subject", ">", "--older-than", "0"}, "requeue with --subject '>' changes every dead row"},
		{[]string{"requeue", "--older-than", "0s", "--limit", "1"}, "requeue with --older-than 0 changes every dead row"},
		{[]string{"purge", "--all", "--older-than", "0"}, "--all and filters exclude each other (got --all and --older-than)"},
		{[]string{"purge", "--subject", "", "--older-than", "1h"}, `invalid --subject "": empty; omit --subject for every subject`},
		{[]string{"purge", "--id", ""}, `invalid --id "": no message id`},
		{[]string{"requeue", "--id", " , "}, `invalid --id " , ": no message id`},
		{[]string{"purge", e.ids["adead"].String()}, fmt.Sprintf(`purge takes no arguments (got [%q]): give message ids with --id`, e.ids["adead"])},
		{[]string{"list", "extra"}, `list takes no arguments (got ["extra"])`},
		{[]string{"show", e.ids["adead"].String(), "--dry-run"}, "show takes a message id and no filters (got --dry-run)"},
		{[]string{"show", e.ids["adead"].String(), "--limit", "5"}, "show takes a message id and no filters (got --limit)"},
	} {
		args := append([]string{"dead"}, c.args...)
		if code, _, errOut := cli(t, e.args(args...)...); code != 2 || !strings.Contains(errOut, c.want) {
			t.Errorf("%q = %d (%q), want 2 saying %q", args, code, errOut, c.want)
		}
	}
	var dead int
	if err := e.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM txoutbox_messages WHERE state = 'dead'`).Scan(&dead); err != nil || dead != 3 {
		t.Fatalf("%d dead rows after the refused commands (%v), want 3", dead, err)
	}

	// requeue --dry-run changes nothing.
	code, out, _ = cli(t, e.args("dead", "requeue", "--subject", "orders.paid", "--dry-run")...)
	if code != 0 || !strings.Contains(out, "2 dead rows would be requeued") {
		t.Fatalf("requeue --dry-run = %d: %s", code, out)
	}
	if st, _, _, _ := e.row("pdead-new"); st != "dead" {
		t.Fatalf("dry run changed the row to %s", st)
	}

	// requeue: ready again, attempts 0, error cleared; only the filtered rows.
	code, out, errOut = cli(t, e.args("dead", "requeue", "--subject", "orders.paid", "--newer-than", "1h")...)
	if code != 0 || !strings.Contains(out, "1 dead row requeued") || !strings.Contains(out, e.ids["pdead-new"].String()) {
		t.Fatalf("requeue = %d: %s%s", code, out, errOut)
	}
	if st, att, le, _ := e.row("pdead-new"); st != "ready" || att != 0 || le != nil {
		t.Fatalf("requeued row: state %s, attempts %d, last_error %v", st, att, le)
	}
	if st, _, _, _ := e.row("pdead-old"); st != "dead" {
		t.Fatalf("a row outside the filter was requeued (%s)", st)
	}

	// purge by id, then --all.
	code, out, _ = cli(t, e.args("dead", "purge", "--id", e.ids["pdead-old"].String(), "--json")...)
	var res struct {
		Action string      `json:"action"`
		IDs    []uuid.UUID `json:"message_ids"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &res) != nil || res.Action != "purge" || len(res.IDs) != 1 || res.IDs[0] != e.ids["pdead-old"] {
		t.Fatalf("purge --id = %d: %s", code, out)
	}
	if _, _, _, found := e.row("pdead-old"); found {
		t.Fatal("the purged row is still there")
	}
	code, out, _ = cli(t, e.args("dead", "purge", "--all")...)
	if code != 0 || !strings.Contains(out, "1 dead row purged") {
		t.Fatalf("purge --all = %d: %s", code, out)
	}
	if _, _, _, found := e.row("adead"); found {
		t.Fatal("purge --all left a dead row")
	}
	// Ready rows are never touched by dead commands.
	var ready int
	if err := e.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM txoutbox_messages WHERE state = 'ready'`).Scan(&ready); err != nil || ready != 6 {
		t.Fatalf("%d ready rows, want 6 (5 + the requeued one): %v", ready, err)
	}
}

// Flags that select or destroy rows are never read from the environment.
func TestDeadFiltersAreCommandLineOnly(t *testing.T) {
	t.Parallel()
	e := newAdminEnv(t)
	env := map[string]string{"TXOUTBOX_ALL": "true", "TXOUTBOX_ID": e.ids["adead"].String(), "TXOUTBOX_SUBJECT": "audit.log"}
	var out, errb bytes.Buffer
	code := Main(context.Background(), e.args("dead", "purge"), &Env{Stdout: &out, Stderr: &errb, Getenv: func(k string) string { return env[k] }})
	if code != 2 {
		t.Fatalf("dead purge with filters only in the environment = %d (%s%s), want 2: nothing selected on the command line", code, out.String(), errb.String())
	}
	if st, _, _, found := e.row("adead"); !found || st != "dead" {
		t.Fatal("a dead row was purged through the environment")
	}
}

// `migrate down` reverts one migration unless --all is on the command line: TXOUTBOX_ALL in
// the environment must not drop the outbox.
func TestMigrateDownAllIsCommandLineOnly(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	env := map[string]string{"TXOUTBOX_ALL": "true", "TXOUTBOX_STEPS": "99", "DATABASE_URL": testsvc.PostgresDSN(t)}
	var out, errb bytes.Buffer
	code := Main(context.Background(), []string{"migrate", "down", "--schema", db.Schema},
		&Env{Stdout: &out, Stderr: &errb, Getenv: func(k string) string { return env[k] }})
	if code != 0 {
		t.Fatalf("migrate down = %d: %s%s", code, out.String(), errb.String())
	}
	var exists bool
	if err := db.AdminPool.QueryRow(context.Background(), "SELECT to_regclass($1) IS NOT NULL",
		pgx.Identifier{db.Schema, "txoutbox_messages"}.Sanitize()).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if !exists || strings.Count(out.String(), "reverted") != 1 {
		t.Fatalf("migrate down with TXOUTBOX_ALL/STEPS in the environment reverted %q; the outbox table exists: %v", out.String(), exists)
	}
}

// Every admin subcommand refuses, before it connects (exit 2, naming the flag or the
// arguments), what it would otherwise ignore or read wider than typed: arguments to a list, a
// setting the action does not read, a --limit out of 1..100000, and a 0 (or an empty value)
// that has no literal meaning, never read as the default, "any" or "all".
func TestAdminCommandsRefuseWhatTheyWouldIgnore(t *testing.T) {
	t.Parallel()
	id := uuid.NewString()
	for _, c := range []struct {
		args []string
		want string
	}{
		// Lists take no arguments.
		{[]string{"dead", "list", "extra"}, `list takes no arguments (got ["extra"])`},
		{[]string{"dead", "list", id}, "list takes no arguments"},
		{[]string{"prepared", "list", "extra"}, `list takes no arguments (got ["extra"])`},
		{[]string{"prepared", "list", id}, "list takes no arguments"},
		{[]string{"scheduled", "list", "extra"}, `list takes no arguments (got ["extra"])`},
		{[]string{"dead", "requeue", "--all", "extra"}, `requeue takes no arguments (got ["extra"]): give message ids with --id`},
		// --limit: 1 to 100000 wherever it is taken; 0 is neither the default nor "all".
		{[]string{"dead", "list", "--limit", "0"}, "invalid --limit 0: must be between 1 and 100000"},
		{[]string{"dead", "list", "--limit", "100001"}, "invalid --limit 100001: must be between 1 and 100000"},
		{[]string{"dead", "purge", "--all", "--limit", "0"}, "invalid --limit 0: must be between 1 and 100000; omit --limit to purge every row that matches"},
		{[]string{"dead", "requeue", "--subject", "x", "--limit", "0"}, "omit --limit to requeue every row that matches"},
		{[]string{"prepared", "list", "--limit", "0"}, "invalid --limit 0: must be between 1 and 100000"},
		{[]string{"prepared", "list", "--limit", "100001"}, "invalid --limit 100001"},
		{[]string{"scheduled", "list", "--limit", "0"}, "invalid --limit 0: must be between 1 and 100000"},
		{[]string{"scheduled", "list", "--limit", "100001"}, "invalid --limit 100001"},
		// Durations: a 0 is literal (--older-than 0: every row) or refused.
		{[]string{"dead", "list", "--newer-than", "0"}, "invalid --newer-than 0: no row was enqueued less than 0 ago; omit --newer-than for any age"},
		{[]string{"dead", "requeue", "--subject", "x", "--newer-than", "0s"}, "invalid --newer-than 0"},
		{[]string{"dead", "purge", "--older-than", "0"}, "purge with --older-than 0 changes every dead row"},
		{[]string{"dead", "list", "--older-than", "-1"}, "must not be negative"},
		{[]string{"scheduled", "list", "--due-within", "0"}, "invalid --due-within 0s: must be more than 0; omit --due-within for every scheduled message"},
		{[]string{"scheduled", "list", "--due-within", "-1s"}, "must not be negative"},
		// Empty values are not "every".
		{[]string{"dead", "list", "--subject", ""}, `invalid --subject "": empty`},
		{[]string{"dead", "purge", "--id", ","}, `invalid --id ",": no message id`},
		{[]string{"prepared", "resume", "--all", "--group", ""}, `invalid --group "": empty; omit --group for every group`},
		{[]string{"scheduled", "list", "--subject", ""}, `invalid --subject "": empty`},
		{[]string{"scheduled", "cancel", "--biz-key", ""}, `invalid --biz-key "": empty`},
		// A setting the subcommand would ignore.
		{[]string{"dead", "list", "--all"}, "--all goes with requeue and purge only: list would ignore it"},
		{[]string{"dead", "list", "--dry-run"}, "--dry-run goes with requeue and purge only: list would ignore it"},
		{[]string{"dead", "show", id, "--all"}, "show takes a message id and no filters (got --all)"},
		{[]string{"dead", "show", id, "--subject", "x"}, "show takes a message id and no filters (got --subject)"},
		{[]string{"dead", "show", id, "--older-than", "0"}, "show takes a message id and no filters (got --older-than)"},
		{[]string{"prepared", "list", "--all"}, "--all goes with resume only: list would ignore it"},
		{[]string{"prepared", "show", id, "--limit", "5"}, "--limit goes with list only: show would ignore it"},
		{[]string{"prepared", "show", id, "--state", "all"}, "--state goes with list only: show would ignore it"},
		{[]string{"prepared", "resume", "--all", "--limit", "1"}, "--limit goes with list only: resume would ignore it"},
		{[]string{"prepared", "resume", "--all", "--state", "prepared"}, "--state goes with list only: resume would ignore it"},
		{[]string{"prepared", "commit", id, "--group", "g"}, "--group goes with list and resume only: commit would ignore it"},
		{[]string{"prepared", "rollback", id, "--all"}, "--all goes with resume only: rollback would ignore it"},
		{[]string{"prepared", "resume", id, "--group", "g"}, "--group goes with --all"},
		{[]string{"scheduled", "cancel", "--biz-key", "k", "--subject", "orders.x"}, "--subject goes with list only: cancel would ignore it"},
		{[]string{"scheduled", "cancel", id, "--due-within", "1h"}, "--due-within goes with list only: cancel would ignore it"},
		{[]string{"scheduled", "cancel", id, "--limit", "5"}, "--limit goes with list only: cancel would ignore it"},
		{[]string{"scheduled", "list", "--biz-key", "k"}, "--biz-key goes with cancel only: list would ignore it"},
		// migrate: down --steps 2 --all reverted every migration.
		{[]string{"migrate", "down", "--steps", "2", "--all"}, "--steps and --all together"},
		{[]string{"migrate", "up", "--all"}, "--all goes with down only: up would ignore it"},
		{[]string{"migrate", "status", "--steps", "3"}, "--steps goes with down only: status would ignore it"},
		{[]string{"migrate", "export", "--dir", t.TempDir(), "--steps", "3"}, "--steps goes with down only: export would ignore it"},
		{[]string{"migrate", "up", "--dir", "d"}, "--dir goes with export only: up would ignore it"},
		{[]string{"migrate", "down", "--format", "goose"}, "--format goes with export only: down would ignore it"},
	} {
		// An unreachable database: each is refused before a connection is tried.
		code, out, errOut := cli(t, append(c.args, "--database-url", "postgres://127.0.0.1:1/none")...)
		if code != 2 || !strings.Contains(errOut, c.want) {
			t.Errorf("relay %q: exit %d, %q %q; want exit 2 saying %q", c.args, code, out, errOut, c.want)
		}
	}
}
