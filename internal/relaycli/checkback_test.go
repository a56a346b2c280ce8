package relaycli

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// cli runs the relay command with vars as its environment and returns its exit status and
// output.
func cliEnv(t *testing.T, vars map[string]string, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := Main(context.Background(), args, &Env{Stdout: &out, Stderr: &errOut, Getenv: func(k string) string { return vars[k] }})
	return code, out.String(), errOut.String()
}

func TestCheckbackAndPreparedCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{"DATABASE_URL": db.DSN, "NATS_URL": n.URL(), "TXOUTBOX_SCHEMA": db.Schema}
	state := func(h outbox.Half) string {
		var s string
		if err := db.Pool.QueryRow(ctx, `SELECT state FROM txoutbox_messages WHERE message_id = $1`, h.ID).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	// No checker serves "orders": with one check allowed, the row is exhausted at once.
	checked, _ := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created", Key: "o1"}, &outbox.PrepareOptions{Group: "orders"})
	fenced, _ := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Fence: true})
	other, _ := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Group: "orders", CheckImmunity: 1 << 62})

	vars["TXOUTBOX_CHECK_MAX"] = "1" // settings come from the environment too
	code, out, errOut := cliEnv(t, vars, "checkback", "--once", "--check-transaction-timeout", "1ms", "--log-level", "error")
	// A check nobody answered fails the run, so that a cron job sees it.
	if code != 1 || !strings.Contains(errOut, "1 check of a half message got no answer from its checker (no_responders 1)") {
		t.Fatalf("checkback --once with no checker: exit %d, want 1 naming no_responders:\n%s", code, errOut)
	}
	for _, want := range []string{"fenced 1", "no_responders 1", "exhausted 1", "prepared: 1, check_exhausted: 1", "purge:"} {
		if !strings.Contains(out, want) {
			t.Errorf("checkback --once output lacks %q:\n%s", want, out)
		}
	}
	if state(checked) != "check_exhausted" || state(fenced) != "rolled_back" || state(other) != "prepared" {
		t.Fatalf("states after the check-back: %s %s %s", state(checked), state(fenced), state(other))
	}

	code, out, errOut = cliEnv(t, vars, "prepared", "list")
	if code != 0 || !strings.Contains(out, checked.ID.String()) || !strings.Contains(out, other.ID.String()) || !strings.Contains(out, "check_exhausted") {
		t.Fatalf("prepared list: exit %d\n%s%s", code, out, errOut)
	}
	code, out, _ = cliEnv(t, vars, "prepared", "list", "--state", "check_exhausted", "--json")
	var rows []struct {
		MessageID string `json:"message_id"`
		State     string `json:"state"`
		Checks    int    `json:"checks"`
		LastError string `json:"last_error"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &rows) != nil || len(rows) != 1 ||
		rows[0].MessageID != checked.ID.String() || rows[0].Checks != 1 || !strings.Contains(rows[0].LastError, "no_responders") {
		t.Fatalf("prepared list --json: exit %d: %s", code, out)
	}

	// Resume, then commit it; roll back the other (settings after the id work too).
	if code, out, errOut = cliEnv(t, vars, "prepared", "resume", checked.ID.String()); code != 0 || !strings.Contains(out, "resumed") || state(checked) != "prepared" {
		t.Fatalf("resume: exit %d: %s%s (state %s)", code, out, errOut, state(checked))
	}
	if code, _, _ = cliEnv(t, vars, "prepared", "resume", other.ID.String()); code != 1 {
		t.Fatalf("resume of a prepared row: exit %d, want 1", code)
	}
	if code, out, errOut = cliEnv(t, vars, "prepared", "commit", checked.ID.String()); code != 0 || state(checked) != "ready" {
		t.Fatalf("commit: exit %d: %s%s", code, out, errOut)
	}
	if code, out, errOut = cliEnv(t, vars, "prepared", "rollback", other.ID.String(), "--schema", db.Schema); code != 0 || state(other) != "rolled_back" {
		t.Fatalf("rollback: exit %d: %s%s", code, out, errOut)
	}
	code, _, errOut = cliEnv(t, vars, "prepared", "commit", other.ID.String())
	if code != 1 || !strings.Contains(errOut, "it is rolled_back") {
		t.Fatalf("commit of a rolled back row: exit %d: %s", code, errOut)
	}
	var settledBy string
	_ = db.Pool.QueryRow(ctx, `SELECT settled_by FROM txoutbox_messages WHERE message_id = $1`, checked.ID).Scan(&settledBy)
	if settledBy != "operator" {
		t.Fatalf("settled_by %q, want operator", settledBy)
	}

	// Usage errors exit 2 and name the problem.
	for _, args := range [][]string{
		{"prepared", "resume"},
		{"prepared", "commit"},
		{"prepared", "commit", "not-a-uuid"},
		{"prepared", "list", "--state", "ready"},
		{"checkback", "--once", "--check-schedule", "sometimes"},
		{"checkback", "--once", "--check-backoff-jitter", "2"},
	} {
		if code, _, errOut := cliEnv(t, vars, args...); code != 2 || errOut == "" {
			t.Errorf("%v: exit %d (%s), want 2", args, code, errOut)
		}
	}
}

func TestHelpListsCheckbackSettings(t *testing.T) {
	t.Parallel()
	_, out, _ := cliEnv(t, nil, "run", "--help")
	for _, want := range []string{"--no-checkback", "TXOUTBOX_NO_CHECKBACK", "--check-transaction-timeout", "TXOUTBOX_CHECK_TRANSACTION_TIMEOUT",
		"default 6s", "--check-max", "default 15", "--dedup-retention", "--purge-schedule"} {
		if !strings.Contains(out, want) {
			t.Errorf("relay run --help lacks %q", want)
		}
	}
	// A flag too long for the first column gets a line of its own; its description stays in
	// the column of the others (it was pushed right).
	if !strings.Contains(out, "    --check-transaction-timeout value\n"+strings.Repeat(" ", 35)+"check a half message") {
		t.Errorf("relay run --help: --check-transaction-timeout's description is not aligned with the others:\n%s", out)
	}
	_, out, _ = cliEnv(t, nil, "checkback", "--help")
	for _, want := range []string{"--once", "--retention", "TXOUTBOX_RETENTION", "--check-group-rate", "--stale-ready-after"} {
		if !strings.Contains(out, want) {
			t.Errorf("relay checkback --help lacks %q", want)
		}
	}
	code, _, errOut := cliEnv(t, nil, "run", "--check-max", "0", "--database-url", "postgres://x")
	if code != 2 || !strings.Contains(errOut, "--check-max") {
		t.Errorf("relay run --check-max 0: exit %d: %s", code, errOut)
	}
	// --create-stream without --subjects created nothing, silently.
	code, _, errOut = cliEnv(t, nil, "run", "--create-stream", "ORDERS", "--database-url", "postgres://x")
	if code != 2 || !strings.Contains(errOut, "invalid --create-stream: needs Subjects") {
		t.Errorf("relay run --create-stream without --subjects: exit %d: %s", code, errOut)
	}
}

// --check-group-rate takes -1 for no rate limit (checkback.Config.GroupRate = txoutbox.Forever)
// and refuses 0 and other negative rates.
func TestCheckGroupRateFlag(t *testing.T) {
	t.Parallel()
	for rate, ok := range map[float64]bool{-1: true, 0.5: true, 0: false, -2: false} {
		c := (&checkback.Config{}).WithDefaults()
		c.GroupRate = rate
		err := checkCheckbackFlags(c)
		if (err == nil) != ok || (err != nil && !strings.Contains(err.Error(), "--check-group-rate")) {
			t.Errorf("--check-group-rate %v: %v, want accepted %v (a refusal naming the flag)", rate, err, ok)
		}
	}
}
