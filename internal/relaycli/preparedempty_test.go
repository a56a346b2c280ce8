package relaycli

import (
	"context"
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// relay prepared list with no matching row says so under its header, naming what it looked
// for, as dead list ("0 dead rows listed") and scheduled list ("(no scheduled messages)") do;
// it printed the header alone. --json stays an empty array, and a list with rows has no such
// line.
func TestPreparedListSaysWhenThereIsNone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema}
	const header = "MESSAGE ID"

	empty := []struct {
		args []string
		want string
	}{
		{nil, "(no prepared or check_exhausted messages)"},
		{[]string{"--state", "prepared"}, "(no prepared messages)"},
		{[]string{"--state", "check_exhausted"}, "(no check_exhausted messages)"},
		{[]string{"--group", "refunds"}, "(no prepared or check_exhausted messages of group refunds)"},
	}
	for _, c := range empty {
		code, out, errOut := cliEnv(t, vars, append([]string{"prepared", "list"}, c.args...)...)
		if code != 0 || !strings.HasPrefix(out, header) || !strings.HasSuffix(out, "\n"+c.want+"\n") {
			t.Errorf("prepared list %q with none: exit %d, %q %q; want the header, then %q", c.args, code, out, errOut, c.want)
		}
	}
	if code, out, errOut := cliEnv(t, vars, "prepared", "list", "--json"); code != 0 || strings.TrimSpace(out) != "[]" {
		t.Errorf("prepared list --json with none: exit %d, %q %q; want []", code, out, errOut)
	}

	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "payments.charged", Payload: []byte("x")}, &outbox.PrepareOptions{Group: "payments"}); err != nil {
		t.Fatal(err)
	}
	if code, out, errOut := cliEnv(t, vars, "prepared", "list"); code != 0 || !strings.Contains(out, "payments.charged") || strings.Contains(out, "(no ") {
		t.Errorf("prepared list with one half message: exit %d, %q %q; want its row and no \"(no …)\" line", code, out, errOut)
	}
	// Rows of other states or groups are not the ones looked for.
	for _, c := range empty[2:] {
		code, out, errOut := cliEnv(t, vars, append([]string{"prepared", "list"}, c.args...)...)
		if code != 0 || strings.Contains(out, "payments.charged") || !strings.HasSuffix(out, "\n"+c.want+"\n") {
			t.Errorf("prepared list %q with a prepared row of group payments: exit %d, %q %q; want none, saying %q", c.args, code, out, errOut, c.want)
		}
	}
}
