package relaycli

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/outbox"
)

// dead list, prepared list and scheduled list --json cut at --limit say so on stderr, as the
// text lists say it under their table, and stdout stays one JSON array; they printed the
// first --limit rows and nothing else, so a script could not tell a cut list from a whole
// one. A list that is not cut says nothing on stderr.
func TestAuditJSONListSaysWhenCut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newAdminEnv(t) // 3 dead rows
	c, err := outbox.NewClient(&outbox.Config{Schema: e.db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := c.Prepare(ctx, e.db.Pool, outbox.Message{Subject: "payments.charged", Payload: []byte("x")}, &outbox.PrepareOptions{Group: "payments"}); err != nil {
			t.Fatal(err)
		}
	}
	due := time.Now().Add(time.Hour)
	if _, err := c.EnqueueTx(ctx, e.db.Pool, outbox.Message{Subject: "orders.expire", Key: "s1", DeliverAt: due},
		outbox.Message{Subject: "orders.expire", Key: "s2", DeliverAt: due}, outbox.Message{Subject: "orders.expire", Key: "s3", DeliverAt: due}); err != nil {
		t.Fatal(err)
	}

	for _, cmd := range []string{"dead", "prepared", "scheduled"} {
		for _, lim := range []struct {
			limit string
			rows  int
			more  bool
		}{{"2", 2, true}, {"3", 3, false}, {"4", 3, false}} {
			code, out, errOut := cli(t, e.args(cmd, "list", "--json", "--limit", lim.limit)...)
			var rows []map[string]any
			if err := json.Unmarshal([]byte(out), &rows); code != 0 || err != nil {
				t.Errorf("%s list --json --limit %s: exit %d, stdout not one JSON array (%v):\n%s%s", cmd, lim.limit, code, err, out, errOut)
				continue
			}
			if len(rows) != lim.rows {
				t.Errorf("%s list --json --limit %s: %d rows, want %d", cmd, lim.limit, len(rows), lim.rows)
			}
			want := ""
			if lim.more {
				want = "(first 2 shown; raise --limit for more)\n"
			}
			if errOut != want {
				t.Errorf("%s list --json --limit %s of 3 rows: stderr %q, want %q", cmd, lim.limit, errOut, want)
			}
		}
	}
}

// dead list, requeue and purge count one row in the singular: "1 dead row listed", not "1
// dead rows listed".
func TestAuditDeadCountsSingular(t *testing.T) {
	t.Parallel()
	e := newAdminEnv(t) // dead: pdead-old, pdead-new, adead
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"list", "--subject", "audit.log"}, "\n1 dead row listed\n"},
		{[]string{"list", "--limit", "1"}, "\n1 dead row listed (the first 1; raise --limit for more)\n"},
		{[]string{"list", "--subject", "orders.paid"}, "\n2 dead rows listed\n"},
		{[]string{"list", "--subject", "nothing.here"}, "\n0 dead rows listed\n"},
		{[]string{"requeue", "--id", e.ids["pdead-new"].String(), "--dry-run"}, "\n1 dead row would be requeued\n"},
		{[]string{"requeue", "--id", e.ids["pdead-new"].String()}, "\n1 dead row requeued\n"},
		{[]string{"purge", "--subject", "audit.log"}, "\n1 dead row purged\n"},
		{[]string{"purge", "--subject", "audit.log"}, "0 dead rows purged\n"},
	} {
		code, out, errOut := cli(t, e.args(append([]string{"dead"}, c.args...)...)...)
		if code != 0 || !strings.HasSuffix("\n"+out, c.want) {
			t.Errorf("dead %q: exit %d, %q %q; want it to end %q", c.args, code, out, errOut, c.want)
		}
	}
}
