package relaycli

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// relay prepared list says "raise --limit for more" only when there are more half messages
// than --limit (it reads one more), and refuses arguments and a --limit out of 1..100000; a
// setting resume would ignore (--limit, --state) or an empty --group is refused and resumes
// nothing (resume --all --limit 1 resumed them all).
func TestPreparedListAndRefusals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema}
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var halves []uuid.UUID
	for range 3 {
		h, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "payments.charged", Payload: []byte("x")}, &outbox.PrepareOptions{Group: "payments"})
		if err != nil {
			t.Fatal(err)
		}
		halves = append(halves, h.ID)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'check_exhausted' WHERE message_id = ANY($1)`, halves); err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct {
		args []string
		more bool
	}{{[]string{"--limit", "2"}, true}, {[]string{"--limit", "3"}, false}, {[]string{"--limit", "4"}, false}, {nil, false}} {
		code, out, errOut := cliEnv(t, vars, append([]string{"prepared", "list"}, c.args...)...)
		if code != 0 || strings.Contains(out, "(first 2 shown; raise --limit for more)") != c.more || strings.Contains(out, "raise --limit") != c.more {
			t.Errorf("prepared list %v of 3 half messages: exit %d, %s%s; want the \"more\" line %v", c.args, code, out, errOut, c.more)
		}
		want := 3
		if c.more {
			want = 2
		}
		if shown := strings.Count(out, "check_exhausted"); code == 0 && shown != want {
			t.Errorf("prepared list %v: %d rows shown:\n%s", c.args, shown, out)
		}
	}

	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"list", "extra"}, `list takes no arguments (got ["extra"])`},
		{[]string{"list", halves[0].String()}, "list takes no arguments"},
		{[]string{"list", "--limit", "0"}, "invalid --limit 0: must be between 1 and 100000"},
		{[]string{"list", "--limit", "-1"}, "invalid --limit -1: must be between 1 and 100000"},
		{[]string{"list", "--limit", "100001"}, "invalid --limit 100001: must be between 1 and 100000"},
		{[]string{"list", "--group", ""}, `invalid --group "": empty; omit --group for every group`},
		{[]string{"resume", "--all", "--limit", "1"}, "--limit goes with list only: resume would ignore it"},
		{[]string{"resume", "--all", "--state", "prepared"}, "--state goes with list only: resume would ignore it"},
		{[]string{"resume", "--all", "--group", ""}, `invalid --group "": empty`},
		{[]string{"commit", halves[0].String(), "--limit", "1"}, "--limit goes with list only: commit would ignore it"},
	} {
		code, out, errOut := cliEnv(t, vars, append([]string{"prepared"}, c.args...)...)
		if code != 2 || !strings.Contains(errOut, c.want) {
			t.Errorf("prepared %q: exit %d, %q %q; want exit 2 saying %q", c.args, code, out, errOut, c.want)
		}
	}
	var exhausted int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages WHERE state = 'check_exhausted'`).Scan(&exhausted); err != nil || exhausted != 3 {
		t.Fatalf("%d check_exhausted rows after the refused commands (%v), want 3", exhausted, err)
	}
}
