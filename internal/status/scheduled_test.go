package status

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// planNode is a node of EXPLAIN (FORMAT JSON)'s plan.
type planNode struct {
	NodeType     string     `json:"Node Type"`
	Relation     string     `json:"Relation Name"`
	Index        string     `json:"Index Name"`
	ActualRows   float64    `json:"Actual Rows"`
	ActualLoops  float64    `json:"Actual Loops"`
	RowsFiltered float64    `json:"Rows Removed by Filter"`
	Plans        []planNode `json:"Plans"`
}

func (n planNode) walk(f func(planNode)) {
	f(n)
	for _, c := range n.Plans {
		c.walk(f)
	}
}

// The scheduled panel reads a bounded number of scheduled rows, through the scheduled index,
// however many wait (it read every one per refresh: a parallel sequential scan of a million
// far-future rows every 5 s while the status page was open), and says "at least" when it did
// not count them all; the overdue rows, the first in due order, and the last delivery time
// stay exact.
func TestScheduledPanelBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	q := store.New(db.Schema)
	const far, overdue, limit = 20000, 3, 500
	if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, deliver_at)
SELECT gen_random_uuid(), 'orders.far' || (g % 2), g, '\x00'::bytea, 'scheduled', now() + interval '1 day' + g * interval '1 second'
FROM generate_series(1, $1) g
UNION ALL
SELECT gen_random_uuid(), 'orders.late', g, '\x00'::bytea, 'scheduled', now() - g * interval '1 minute' FROM generate_series(1, $2) g`, far, overdue); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `ANALYZE txoutbox_messages`); err != nil {
		t.Fatal(err)
	}
	var last time.Time
	if err := db.Pool.QueryRow(ctx, `SELECT max(deliver_at) FROM txoutbox_messages`).Scan(&last); err != nil {
		t.Fatal(err)
	}

	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	// The status, and the metrics' sample (count up to its limit, the next due time) too: it
	// reads the rows past their delivery time (at most 1,000 of them) and the first not yet
	// due, through the scheduled index.
	for _, c := range []struct {
		what    string
		explain func(ctx context.Context, conn *pgx.Conn, limit int, generic bool) ([]byte, error)
		most    float64
	}{
		{"status (its limit and the last row)", q.ExplainScheduledStatus, limit + 1},
		{"sample (its count's limit, the overdue rows, the next)", q.ExplainScheduledSample, limit + overdue + 1},
	} {
		for _, generic := range []bool{false, true} {
			out, err := c.explain(ctx, conn.Conn(), limit, generic)
			if err != nil {
				t.Fatal(err)
			}
			var doc []struct{ Plan planNode }
			if err := json.Unmarshal(out, &doc); err != nil || len(doc) != 1 {
				t.Fatalf("EXPLAIN output: %v: %s", err, out)
			}
			read := 0.0
			doc[0].Plan.walk(func(n planNode) {
				if n.Relation != "txoutbox_messages" {
					return
				}
				if n.Index != "txoutbox_messages_scheduled_idx" {
					t.Errorf("%s, generic %v: reads the outbox with a %s %s, want the scheduled index\n%s", c.what, generic, n.NodeType, n.Index, out)
				}
				read += (n.ActualRows + n.RowsFiltered) * max(n.ActualLoops, 1)
			})
			if read > c.most {
				t.Errorf("%s, generic %v: read %v scheduled rows, want at most %v", c.what, generic, read, c.most)
			}
		}
	}

	tb, err := scheduledTable(ctx, db.Pool, q, limit, &Snapshot{})
	if err != nil || tb == nil {
		t.Fatalf("panel: %v, %v", tb, err)
	}
	total := tb.Rows[len(tb.Rows)-1]
	if total[0] != "TOTAL" || total[1] != "at least 500" || total[2] != "3" || total[5] != last.UTC().Format(time.RFC3339) {
		t.Errorf("TOTAL row %q; want at least 500 scheduled, 3 overdue, the last due at %s", total, last.UTC().Format(time.RFC3339))
	}
	if !strings.Contains(tb.Note, "first 500") {
		t.Errorf("note %q does not say the counts are capped", tb.Note)
	}
	// Below the limit: exact.
	tb, err = scheduledTable(ctx, db.Pool, q, far+overdue+1, &Snapshot{})
	if err != nil {
		t.Fatal(err)
	}
	if total := tb.Rows[len(tb.Rows)-1]; total[1] != "20003" || total[2] != "3" || strings.Contains(tb.Note, "first") {
		t.Errorf("uncapped TOTAL row %q, note %q; want 20003 exact", total, tb.Note)
	}
}

// Scheduled rows overdue by more than OverdueAfter are listed under "Needs attention" (a
// running relay promotes a due row within its poll interval: no relay runs, or a key is held
// by an open transaction), their subject flagged; rows just due are not a problem.
func TestScheduledPanelOverdueNeedsAttention(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	q := store.New(db.Schema)
	// A row inserted at created_at (a back-dated fixture: committed then) to be delivered at
	// now + due.
	insert := func(subject, due, created string) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, deliver_at, created_at)
VALUES (gen_random_uuid(), $1, 1, '\x00'::bytea, 'scheduled', now() + $2::interval, now() + $3::interval)`, subject, due, created); err != nil {
			t.Fatal(err)
		}
	}
	insert("orders.soon", "1 hour", "0")
	insert("orders.just", "-1 second", "-1 hour")
	// Committed just now with a delivery time three minutes past (the caller's choice): due
	// now, not three minutes overdue.
	insert("orders.backdated", "-3 minutes", "0")
	snap := &Snapshot{}
	tb, err := scheduledTable(ctx, db.Pool, q, ScheduledLimit, snap)
	if err != nil || tb == nil {
		t.Fatalf("panel: %v, %v", tb, err)
	}
	if len(tb.Problems) != 0 || len(tb.Flagged) != 0 {
		t.Fatalf("a row due a second ago is a problem: %q (flagged %v)", tb.Problems, tb.Flagged)
	}
	if strings.Contains(tb.Note, "if they stay, no relay is running.") || !strings.Contains(tb.Note, "held by an open transaction") {
		t.Errorf("note %q does not name both causes of overdue rows", tb.Note)
	}
	if sc := snap.Scheduled; sc.Count != 3 || !sc.CountExact || sc.Overdue != 2 || sc.Stuck || sc.NextDue == nil ||
		sc.NextDueSeconds < -30 || sc.NextDueSeconds > 0 || len(sc.Subjects) != 3 {
		t.Errorf("typed summary %+v; want 3 scheduled (exact), 2 overdue, the earliest due about now, not stuck, 3 subjects", sc)
	}
	insert("orders.late", "-3 minutes", "-1 hour")
	snap = &Snapshot{}
	tb, err = scheduledTable(ctx, db.Pool, q, ScheduledLimit, snap)
	if err != nil || tb == nil {
		t.Fatalf("panel: %v, %v", tb, err)
	}
	if len(tb.Problems) != 1 || !strings.Contains(tb.Problems[0], "3 scheduled rows overdue, the oldest by 3m") ||
		!strings.Contains(tb.Problems[0], "no relay is running, or a key is held by an open transaction") {
		t.Fatalf("problems %q; want one naming the 2 overdue rows, the oldest 3m late, and both causes", tb.Problems)
	}
	var flagged []string
	for _, i := range tb.Flagged {
		flagged = append(flagged, tb.Rows[i][0])
	}
	if len(flagged) != 1 || flagged[0] != "orders.late" {
		t.Errorf("flagged subjects %v, want [orders.late]", flagged)
	}
	if sc := snap.Scheduled; sc.Overdue != 3 || !sc.Stuck || sc.NextDueSeconds > -170 || sc.NextDueSeconds < -200 {
		t.Errorf("typed summary %+v; want 3 overdue, stuck, the earliest due about 3 minutes ago", sc)
	}
}

// The last due time when every scheduled row is past its delivery time is the latest due
// time, not the due time of the row with the latest delivery time: a row committed just now
// with a delivery time two hours past is due now, after a row due an hour ago.
func TestScheduledLastDueWhenAllOverdue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	q := store.New(db.Schema)
	if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, deliver_at, created_at)
VALUES (gen_random_uuid(), 'orders.a', 1, '\x00'::bytea, 'scheduled', now() - interval '1 hour', now() - interval '2 hours'),
       (gen_random_uuid(), 'orders.b', 2, '\x00'::bytea, 'scheduled', now() - interval '2 hours', now())`); err != nil {
		t.Fatal(err)
	}
	st, err := q.ScheduledStatuses(ctx, db.Pool, ScheduledLimit)
	if err != nil {
		t.Fatal(err)
	}
	if late := time.Since(st.LastDue); late < 0 || late > time.Minute {
		t.Errorf("last due %v (%v ago); want about now, row b's due time", st.LastDue, late)
	}
}
