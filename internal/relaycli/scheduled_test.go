package relaycli

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

func TestScheduledCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema}

	for _, args := range [][]string{{"scheduled", "list", "--json"}} {
		if code, out, errOut := cliEnv(t, vars, args...); code != 0 || out != "[]\n" {
			t.Fatalf("%v on an empty outbox: exit %d, %q %s", args, code, out, errOut)
		}
	}
	soon, later := time.Now().Add(10*time.Minute), time.Now().Add(48*time.Hour)
	ids, err := c.EnqueueTx(ctx, db.Pool,
		outbox.Message{Subject: "orders.timeout", Key: "order-1", BizKey: "order:1:timeout:x", DeliverAt: later},
		outbox.Message{Subject: "orders.remind", Key: "order-1", DeliverAt: soon},
		outbox.Message{Subject: "orders.remind", Key: "order-2", BizKey: "order:2:remind:y", DeliverAt: later},
		outbox.Message{Subject: "orders.created", Key: "order-1"},
	)
	if err != nil {
		t.Fatal(err)
	}

	code, out, errOut := cliEnv(t, vars, "scheduled", "list", "--json")
	if code != 0 {
		t.Fatalf("list: exit %d: %s", code, errOut)
	}
	checkJSONConvention(t, "scheduled list --json", out)
	var rows []struct {
		MessageID string    `json:"message_id"`
		Subject   string    `json:"subject"`
		BizKey    string    `json:"biz_key"`
		DeliverAt time.Time `json:"deliver_at"`
	}
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatal(err)
	}
	if len(rows) != 3 || rows[0].MessageID != ids[1].String() || rows[1].MessageID != ids[0].String() || rows[2].MessageID != ids[2].String() {
		t.Fatalf("list = %s; want the 3 scheduled messages, first due first", out)
	}
	code, out, _ = cliEnv(t, vars, "scheduled", "list", "--due-within", "1h", "--json")
	if code != 0 || !strings.Contains(out, ids[1].String()) || strings.Contains(out, ids[0].String()) {
		t.Fatalf("list --due-within 1h: exit %d, %s; want only the message due in 10 minutes", code, out)
	}
	code, out, _ = cliEnv(t, vars, "scheduled", "list", "--subject", "orders.timeout")
	if code != 0 || !strings.Contains(out, ids[0].String()) || strings.Contains(out, ids[1].String()) || !strings.Contains(out, "order:1:timeout:x") {
		t.Fatalf("list --subject: exit %d, %s", code, out)
	}
	// "More" is said when there are more, not when exactly --limit rows came back.
	for _, c := range []struct {
		limit string
		more  bool
	}{{"2", true}, {"3", false}, {"4", false}} {
		code, out, _ := cliEnv(t, vars, "scheduled", "list", "--limit", c.limit)
		if code != 0 || strings.Contains(out, "raise --limit for more") != c.more {
			t.Errorf("list --limit %s of 3 scheduled: exit %d, %s; want the \"more\" line %v", c.limit, code, out, c.more)
		}
	}
	// list takes no arguments, and an exact, valid subject.
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"extra"}, `list takes no arguments (got ["extra"])`},
		{[]string{ids[0].String()}, "list takes no arguments"},
		{[]string{"--subject", "orders.*"}, `invalid --subject "orders.*": list takes an exact subject, not a wildcard`},
		{[]string{"--subject", "orders.>"}, "not a wildcard"},
		{[]string{"--subject", "bad subject"}, "invalid --subject:"},
		{[]string{"--subject", "orders..x"}, "invalid --subject:"},
	} {
		code, _, errOut := cliEnv(t, vars, append([]string{"scheduled", "list"}, c.args...)...)
		if code != 2 || !strings.Contains(errOut, c.want) {
			t.Errorf("scheduled list %q: exit %d, %q; want exit 2 saying %q", c.args, code, errOut, c.want)
		}
	}

	// The status shows the scheduled messages and the next due time.
	code, out, errOut = cliEnv(t, vars, "status")
	if code != 0 || !strings.Contains(out, "SCHEDULED (DELAYED) MESSAGES BY SUBJECT") || !strings.Contains(out, soon.UTC().Format(time.RFC3339)) {
		t.Fatalf("status: exit %d, %s %s; want the scheduled panel with the next due time", code, out, errOut)
	}
	code, out, _ = cliEnv(t, vars, "status", "--json")
	checkJSONConvention(t, "status --json", out)
	if code != 0 || !strings.Contains(out, `"TOTAL",`) || !strings.Contains(out, `"3"`) {
		t.Fatalf("status --json: exit %d, %s", code, out)
	}

	// A list-only setting on cancel is refused and cancels nothing: cancel --biz-key K
	// --subject S cancelled K's messages of every subject. A 0 or an empty value that would
	// have meant "any" is refused on list.
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"cancel", "--biz-key", "order:1:timeout:x", "--subject", "orders.remind"}, "--subject goes with list only: cancel would ignore it"},
		{[]string{"cancel", "--biz-key", "order:1:timeout:x", "--due-within", "1h"}, "--due-within goes with list only: cancel would ignore it"},
		{[]string{"cancel", ids[0].String(), "--limit", "1"}, "--limit goes with list only: cancel would ignore it"},
		{[]string{"cancel", ids[0].String(), "--biz-key", ""}, `invalid --biz-key "": empty`},
		{[]string{"list", "--biz-key", "order:1:timeout:x"}, "--biz-key goes with cancel only: list would ignore it"},
		{[]string{"list", "--due-within", "0"}, "invalid --due-within 0s: must be more than 0; omit --due-within for every scheduled message"},
		{[]string{"list", "--subject", ""}, `invalid --subject "": empty; omit --subject for every subject`},
		{[]string{"list", "--limit", "0"}, "invalid --limit 0: must be between 1 and 100000"},
	} {
		code, out, errOut := cliEnv(t, vars, append([]string{"scheduled"}, c.args...)...)
		if code != 2 || !strings.Contains(errOut, c.want) {
			t.Errorf("scheduled %q: exit %d, %q %q; want exit 2 saying %q", c.args, code, out, errOut, c.want)
		}
	}
	var stillScheduled int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages WHERE state = 'scheduled'`).Scan(&stillScheduled); err != nil || stillScheduled != 3 {
		t.Fatalf("%d scheduled rows after the refused cancels, %v; want 3", stillScheduled, err)
	}

	// Cancel by id: the scheduled one goes; the ready one and an unknown one are refused.
	code, out, errOut = cliEnv(t, vars, "scheduled", "cancel", ids[1].String(), ids[3].String(), "--json")
	if code != 1 {
		t.Fatalf("cancel of a scheduled and a ready message: exit %d, want 1 (%s %s)", code, out, errOut)
	}
	checkJSONConvention(t, "scheduled cancel --json", out)
	var res struct {
		Action     string   `json:"action"`
		MessageIDs []string `json:"message_ids"`
		Failed     []struct {
			MessageID *string `json:"message_id"`
			Reason    string  `json:"reason"`
		} `json:"failed"`
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatal(err)
	}
	if res.Action != "cancel" || len(res.MessageIDs) != 1 || res.MessageIDs[0] != ids[1].String() || len(res.Failed) != 1 ||
		res.Failed[0].MessageID == nil || *res.Failed[0].MessageID != ids[3].String() || res.Failed[0].Reason != "not scheduled: it is ready" {
		t.Fatalf("cancel --json = %s", out)
	}
	// By business key.
	code, out, errOut = cliEnv(t, vars, "scheduled", "cancel", "--biz-key", "order:2:remind:y")
	if code != 0 || out != "cancelled "+ids[2].String()+"\n1 cancelled\n" {
		t.Fatalf("cancel --biz-key: exit %d, %q %s; want a line per message and the count", code, out, errOut)
	}
	// Again: nothing scheduled, and the key's latest state says why (as CancelBizKeyTx does).
	code, out, errOut = cliEnv(t, vars, "scheduled", "cancel", "--biz-key", "order:2:remind:y", "--json")
	var byKey struct {
		MessageIDs []string `json:"message_ids"`
		Failed     []struct {
			MessageID *string `json:"message_id"`
			Reason    string  `json:"reason"`
		} `json:"failed"`
	}
	if err := json.Unmarshal([]byte(out), &byKey); code != 1 || err != nil || len(byKey.MessageIDs) != 0 || len(byKey.Failed) != 1 ||
		byKey.Failed[0].MessageID != nil || byKey.Failed[0].Reason != `business key "order:2:remind:y": none is scheduled: its latest message is rolled_back` {
		t.Fatalf("second cancel --biz-key --json: exit %d, %s %s; want not cancelled, state rolled_back", code, out, errOut)
	}
	code, out, errOut = cliEnv(t, vars, "scheduled", "cancel", "--biz-key", "order:9:none")
	if code != 1 || !strings.Contains(errOut, `business key "order:9:none": no message has it`) || out != "0 cancelled\n" {
		t.Fatalf("cancel --biz-key of an unknown key: exit %d, %s", code, errOut)
	}
	// A key the producer would refuse is a usage error naming the setting, not "none scheduled".
	for _, bad := range []string{" order:1", "order:1\u00a0", "order\x01"} {
		key, _ := strconv.Unquote(`"` + bad + `"`)
		if code, _, errOut := cliEnv(t, vars, "scheduled", "cancel", "--biz-key", key); code != 2 || !strings.Contains(errOut, "--biz-key") {
			t.Errorf("cancel --biz-key %q: exit %d, %s; want 2 naming --biz-key", key, code, errOut)
		}
	}
	// The same id twice is one cancel with one answer.
	code, out, errOut = cliEnv(t, vars, "scheduled", "cancel", ids[0].String(), ids[0].String())
	if code != 0 || strings.Count(out, "cancelled "+ids[0].String()) != 1 || errOut != "" {
		t.Fatalf("cancel of one id given twice: exit %d, %q %q; want one cancel, exit 0", code, out, errOut)
	}
	if _, err := c.EnqueueTx(ctx, db.Pool, outbox.Message{Subject: "orders.timeout", Key: "order-1", DeliverAt: later}); err != nil {
		t.Fatal(err)
	}
	var left int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages WHERE state = 'scheduled'`).Scan(&left); err != nil || left != 1 {
		t.Fatalf("%d scheduled rows left, %v; want 1", left, err)
	}
	// Usage errors.
	for _, args := range [][]string{{"scheduled"}, {"scheduled", "cancel"}, {"scheduled", "cancel", "x"}, {"scheduled", "list", "--limit", "0"}, {"scheduled", "list", "--limit", "100001"}} {
		if code, _, _ := cliEnv(t, vars, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2", args, code)
		}
	}
}

// relay scheduled list shows how long until a delivery time past the range of a
// time.Duration (292 years), up to MaxDeliverAt, in days: never a negative "in -9223372036854ms".
func TestScheduledListFarAhead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema}
	y2400 := time.Date(2400, 1, 1, 0, 0, 0, 0, time.UTC)
	if _, err := c.EnqueueTx(ctx, db.Pool,
		outbox.Message{Subject: "orders.far", DeliverAt: y2400},
		outbox.Message{Subject: "orders.far", DeliverAt: outbox.MaxDeliverAt},
	); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := cliEnv(t, vars, "scheduled", "list")
	if code != 0 {
		t.Fatalf("list: exit %d: %s", code, errOut)
	}
	days := func(at time.Time) int64 { return (at.Unix() - time.Now().Unix()) / 86400 }
	for _, at := range []time.Time{y2400, outbox.MaxDeliverAt} {
		// The day count may tick over between the list and here.
		if d := days(at); !strings.Contains(out, fmt.Sprintf("in %dd", d)) && !strings.Contains(out, fmt.Sprintf("in %dd", d+1)) {
			t.Errorf("list lacks %q for the row due %v:\n%s", fmt.Sprintf("in %dd", d), at, out)
		}
	}
	if strings.Contains(out, "in -") || strings.Contains(out, "overdue") {
		t.Fatalf("list shows a far delivery time as past:\n%s", out)
	}
}

// relay scheduled list counts DUE from the due time, as the status page does: a message
// committed just now with a delivery time an hour past is due now (due_at), not an hour
// overdue; deliver_at is shown as given.
func TestScheduledListDueFromTheCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema}
	past := time.Now().Add(-time.Hour)
	if _, err := c.EnqueueTx(ctx, db.Pool, outbox.Message{Subject: "orders.timeout", DeliverAt: past}); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := cliEnv(t, vars, "scheduled", "list", "--json")
	var rows []struct {
		DeliverAt time.Time `json:"deliver_at"`
		DueAt     time.Time `json:"due_at"`
	}
	if err := json.Unmarshal([]byte(out), &rows); code != 0 || err != nil || len(rows) != 1 {
		t.Fatalf("list --json: exit %d, %v: %s %s", code, err, out, errOut)
	}
	if d := rows[0].DeliverAt.Sub(past); d < -time.Millisecond || d > time.Millisecond {
		t.Errorf("deliver_at %v, want %v", rows[0].DeliverAt, past)
	}
	if late := time.Since(rows[0].DueAt); late < 0 || late > time.Minute {
		t.Errorf("due_at %v (%v ago), want about now: the commit", rows[0].DueAt, late)
	}
	code, out, _ = cliEnv(t, vars, "scheduled", "list")
	if code != 0 || strings.Contains(out, "overdue 1h") || !strings.Contains(out, "overdue") {
		t.Errorf("list: exit %d\n%s\nwant the row overdue by seconds, not an hour", code, out)
	}
}
