package status

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// With no relay registered, relay status says none is running: a relay that stopped cleanly
// removed its row, so "(no relay has run yet)" was false after one had run.
func TestAuditNoRelayIsRunning(t *testing.T) {
	t.Parallel()
	var b bytes.Buffer
	if err := WriteText(&b, &Snapshot{Schema: "public", Partitions: 1, Partition: []Partition{{}}}); err != nil {
		t.Fatal(err)
	}
	if out := b.String(); !strings.Contains(out, "(no relay is running)") || strings.Contains(out, "has run") {
		t.Fatalf("relay status with no relay registered:\n%s\nwant \"(no relay is running)\"", out)
	}
}

// A group whose checks find no checker is worded from its counts: with every half message
// check_exhausted it said "or its 0 prepared half messages run out of checks"; a count of 1
// is singular.
func TestAuditNoCheckerProblemFromCounts(t *testing.T) {
	t.Parallel()
	const noChecker = "no_responders: no checker serves txoutbox.check.payments"
	for _, c := range []struct {
		prepared, exhausted int64
		want, notWant       string
	}{
		{0, 2, "producer group payments: its checks find no checker (" + noChecker + "), and its 2 half messages ran out of checks " +
			"(check_exhausted): start the group's checker (checker.Serve), then resume them: `relay prepared resume --all --group payments --schema s1`", "prepared half"},
		{0, 1, "and its 1 half message ran out of checks (check_exhausted): start the group's checker (checker.Serve), then resume it: `relay prepared resume --all --group payments --schema s1`", "0 "},
		{1, 0, "; start the group's checker (checker.Serve), or its 1 prepared half message runs out of checks", "exhausted"},
		{3, 0, "; start the group's checker (checker.Serve), or its 3 prepared half messages run out of checks", "exhausted"},
		{2, 1, "or its 2 prepared half messages run out of checks too, as 1 already has (check_exhausted)", "0 "},
		{1, 4, "or its 1 prepared half message runs out of checks too, as 4 already have (check_exhausted)", "0 "},
	} {
		got := noCheckerProblem("s1", "payments", store.GroupHalf{Group: "payments", Prepared: c.prepared, Exhausted: c.exhausted, LastError: noChecker})
		if !strings.Contains(got, c.want) || strings.Contains(got, c.notWant) {
			t.Errorf("%d prepared, %d check_exhausted: %q; want it to contain %q and not %q", c.prepared, c.exhausted, got, c.want, c.notWant)
		}
	}
	// No group: resume by id (resume --all --group "" is refused).
	got := noCheckerProblem("public", "(none)", store.GroupHalf{Exhausted: 2, LastError: noChecker})
	if !strings.Contains(got, "then resume them: `relay prepared list --state check_exhausted`, then `relay prepared resume ID...`") {
		t.Errorf("no group, 2 check_exhausted: %q", got)
	}

	// As Collect lists it for a group whose rows are all check_exhausted.
	db := testsvc.NewDB(t)
	ctx := context.Background()
	for range 2 {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, producer_group, check_mode, check_count, last_error)
			VALUES ($1, 'payments.x', 1, '', 'check_exhausted', 'payments', 'checker', 15, $2)`, uuid.New(), noChecker); err != nil {
			t.Fatal(err)
		}
	}
	s, err := Collect(ctx, db.Pool, store.New(db.Schema), nil)
	if err != nil {
		t.Fatal(err)
	}
	if !containsLine(s.Problems, "and its 2 half messages ran out of checks (check_exhausted)") || containsLine(s.Problems, "0 prepared") {
		t.Fatalf("problems %q, want the group's 2 check_exhausted half messages named", s.Problems)
	}
}

// Counts in the problems and panels are singular for 1.
func TestAuditStatusPlurals(t *testing.T) {
	t.Parallel()
	h := store.Horizon{Prepared: 1, OldestPrepared: 2 * time.Minute}
	if w := horizonWarning(h, time.Minute); !strings.Contains(w, "1 prepared transaction, prepared 2m00s ago, holds back the xmin horizon") ||
		!strings.Contains(w, "ROLLBACK PREPARED it") {
		t.Errorf("one prepared transaction: %q", w)
	}
	for n, want := range map[int64]string{0: "0 rows", 1: "1 row", 2: "2 rows"} {
		if got := plural(n, "row", "rows"); got != want {
			t.Errorf("plural(%d) = %q, want %q", n, got, want)
		}
	}

	// One dead row holding back one ready row of one key, one check_exhausted half message,
	// one ready row and no relay.
	db := testsvc.NewDB(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, msg_key, partition_key, payload, state, attempts, last_error)
		VALUES ($1, 'orders.x', 'k1', 1, '', 'dead', 20, 'boom')`, uuid.New()); err != nil {
		t.Fatal(err)
	}
	s, err := Collect(ctx, db.Pool, store.New(db.Schema), nil)
	if err != nil {
		t.Fatal(err)
	}
	if want := "1 dead row holds back its key: see `relay dead list --schema " + db.Schema + "`, then requeue or purge it"; !containsLine(s.Problems, want) {
		t.Errorf("problems %q lack %q", s.Problems, want)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, msg_key, partition_key, payload) VALUES ($1, 'orders.x', 'k1', 1, '')`, uuid.New()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, producer_group, check_mode, check_count)
		VALUES ($1, 'payments.x', 1, '', 'check_exhausted', 'payments', 'checker', 15)`, uuid.New()); err != nil {
		t.Fatal(err)
	}
	if s, err = Collect(ctx, db.Pool, store.New(db.Schema), nil); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"no relay is running and 1 row waits to be published",
		"1 dead row: 1 ready row of 1 key waits behind it (see Blocked keys)",
		"1 half message ran out of check-backs",
	} {
		if !containsLine(s.Problems, want) {
			t.Errorf("problems %q lack %q", s.Problems, want)
		}
	}
}
