package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/txoutbox/txoutbox/internal/store"
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

func parsePlan(t *testing.T, out []byte) planNode {
	t.Helper()
	var doc []struct{ Plan planNode }
	if err := json.Unmarshal(out, &doc); err != nil || len(doc) != 1 {
		t.Fatalf("EXPLAIN output: %v: %s", err, out)
	}
	return doc[0].Plan
}

// walk calls f on n and every node under it.
func (n planNode) walk(f func(planNode)) {
	f(n)
	for _, c := range n.Plans {
		c.walk(f)
	}
}

func (n planNode) String() string {
	s := ""
	var show func(planNode, string)
	show = func(n planNode, indent string) {
		s += fmt.Sprintf("%s%s %s %s rows=%v loops=%v filtered=%v\n", indent, n.NodeType, n.Relation, n.Index, n.ActualRows, n.ActualLoops, n.RowsFiltered)
		for _, c := range n.Plans {
			show(c, indent+"  ")
		}
	}
	show(n, "")
	return s
}

// The claim walks the ready index in id order and stops after its batch, also on an outbox the
// planner knows nothing about (never analysed: a fresh outbox, a backlog inserted faster than
// autoanalyze runs, autovacuum off) and with the claim floor's range condition: there it chose
// a bitmap scan of the whole backlog and a sort (27-41 ms for a claim of 500 rows over 50,000,
// against 0.5 ms) until the relay's session turned those plans off (store.SetupRelaySession).
// The settle's plan reads its rows by id through an index, and no others.
func TestClaimPlanWithoutStatistics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	const backlog = 20000
	if _, err := e.db.Pool.Exec(ctx, `ALTER TABLE txoutbox_messages SET (autovacuum_enabled = false)`); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, ready_at)
SELECT gen_random_uuid(), 'orders.created', g, '\x00', 'ready', now() FROM generate_series(1, $1) g`, backlog); err != nil {
		t.Fatal(err)
	}
	var reltuples float64
	if err := e.db.Pool.QueryRow(ctx, `SELECT reltuples FROM pg_class WHERE oid = 'txoutbox_messages'::regclass`).Scan(&reltuples); err != nil {
		t.Fatal(err)
	}
	if reltuples > 0 { // -1 when never analysed (PostgreSQL 14 and later), 0 before 14
		t.Fatalf("pg_class.reltuples = %v: the table has statistics, want none (never analysed) for this test", reltuples)
	}
	var minID int64
	if err := e.db.Pool.QueryRow(ctx, `SELECT min(id) FROM txoutbox_messages`).Scan(&minID); err != nil {
		t.Fatal(err)
	}
	r := e.relay(nil)
	conn, _, err := r.lease.acquire(ctx) // the relay's own session, as it claims
	if err != nil {
		t.Fatal(err)
	}
	// JIT compilation would cost the relay's millisecond statements 100-250 ms each time a
	// plan's estimate passes jit_above_cost (a disabled scan's does).
	for name, want := range map[string]string{"jit": "off", "enable_seqscan": "off", "enable_bitmapscan": "off", "plan_cache_mode": "force_generic_plan"} {
		var got string
		if err := conn.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&got); err != nil || got != want {
			t.Errorf("the relay's session has %s = %q (%v), want %q", name, got, err, want)
		}
	}
	// Without a floor, with one below every row, and with one in the middle of the backlog.
	for _, after := range []int64{0, minID - 1, minID + backlog/2} {
		args := store.ClaimArgs{Limit: DefaultBatchSize, PartitionCount: DefaultPartitions, After: after}
		out, err := r.q.ExplainClaim(ctx, conn, args, true)
		if err != nil {
			t.Fatal(err)
		}
		plan := parsePlan(t, out)
		read := 0.0
		plan.walk(func(n planNode) {
			switch n.NodeType {
			case "Sort", "Seq Scan", "Bitmap Heap Scan", "Bitmap Index Scan":
				t.Errorf("floor %d: the claim's plan has a %s: it reads the whole backlog\n%s", after, n.NodeType, plan)
			}
			if n.Index == "txoutbox_messages_ready_idx" {
				read += (n.ActualRows + n.RowsFiltered) * max(n.ActualLoops, 1)
			}
		})
		if read != DefaultBatchSize {
			t.Errorf("floor %d: the claim read %v rows of the ready index, want its batch of %d\n%s", after, read, DefaultBatchSize, plan)
		}
	}
	rows, err := r.q.Claim(ctx, conn, store.ClaimArgs{Limit: DefaultBatchSize, PartitionCount: DefaultPartitions})
	if err != nil || len(rows) != DefaultBatchSize {
		t.Fatalf("claim: %d rows, %v", len(rows), err)
	}
	var settle store.SettleArgs
	for _, row := range rows {
		settle.Published = append(settle.Published, store.Published{ID: row.ID, Stream: "ORDERS", Seq: uint64(row.ID)})
	}
	for _, retain := range []bool{false, true} {
		settle.Retain = retain
		out, err := r.q.ExplainSettle(ctx, conn, settle, true)
		if err != nil {
			t.Fatal(err)
		}
		plan := parsePlan(t, out)
		plan.walk(func(n planNode) {
			if n.Relation != "txoutbox_messages" || n.NodeType == "ModifyTable" {
				return
			}
			if read := (n.ActualRows + n.RowsFiltered) * max(n.ActualLoops, 1); n.NodeType != "Index Scan" || read > DefaultBatchSize {
				t.Errorf("retain %v: the settle reads %v rows of the outbox with a %s %s, want an index scan of its %d ids\n%s", retain, read, n.NodeType, n.Index, DefaultBatchSize, plan)
			}
		})
	}
}
