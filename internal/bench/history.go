package bench

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/relay"
)

func init() {
	register(scenario{name: "history", summary: "the claim's and settle's plans beside a retained history of 10 million published rows, and the purge's pace", flags: historyFlags})
}

// History defaults.
const (
	DefaultHistoryRows = 10_000_000
	// historyChunk is how many history rows one INSERT … SELECT generate_series adds.
	historyChunk = 1_000_000
	// Plan bounds: a claim or settle of a batch may read at most this many buffers per row
	// of the batch (index and heap pages, the key check), and never a sequential scan.
	historyMaxBuffersPerRow = 20
)

type historyOpts struct {
	rows, size, batch int
	retention         time.Duration
	purgeTime         time.Duration
	rate              float64
	ownPostgres       bool
}

// historyFlags is the `history` scenario (issue 18): the relay with --retention keeps the
// rows it published, so the table holds a long history beside a small live backlog. The
// scenario loads --rows published rows (INSERT … SELECT generate_series, in chunks of a
// million, published between two hours and a moment ago) and ANALYZEs, enqueues one batch of
// ready rows the ordinary way, then EXPLAINs (ANALYZE, BUFFERS) the relay's own claim (from
// the start and above a floor) and settle (delete and retain) statements, each with its custom
// and its generic plan (settles rolled back). Each plan must avoid a sequential scan of the
// outbox table and read at most 20 buffers per row of the batch: the history is never
// scanned. Then the check-back's own purge statement (batches of checkback's
// DefaultPurgeBatchSize, published rows older than --retention) runs for --purge-time: its
// rows/s must exceed --rate, the rows/s a soak produces, or the history would grow without
// bound.
func historyFlags(fs *flag.FlagSet) func(context.Context, *run) error {
	o := &historyOpts{}
	fs.IntVar(&o.rows, "rows", DefaultHistoryRows, "published rows in the history")
	fs.IntVar(&o.size, "size", 128, "payload bytes of each history row")
	fs.IntVar(&o.batch, "batch", relay.DefaultBatchSize, "ready rows in the live backlog: one claim's batch")
	fs.DurationVar(&o.retention, "retention", time.Hour, "purge published rows older than this (the history spans two hours: about half of it is older)")
	fs.DurationVar(&o.purgeTime, "purge-time", 20*time.Second, "how long to measure the purge")
	fs.Float64Var(&o.rate, "rate", DefaultSoakRate, "the publish rate the purge must outpace, rows/s")
	fs.BoolVar(&o.ownPostgres, "own-postgres", false, "run against a throwaway PostgreSQL cluster of its own (fsync on, default settings)")
	return func(ctx context.Context, r *run) error { return history(ctx, r, o) }
}

func history(ctx context.Context, r *run, o *historyOpts) error {
	if o.rows < 1 || o.size < 0 || o.batch < 1 || o.retention <= 0 || o.purgeTime <= 0 || o.rate <= 0 {
		return usageErr("--rows, --batch, --retention, --purge-time and --rate must be positive, --size not negative")
	}
	r.ownPostgres = o.ownPostgres
	if err := r.start(ctx); err != nil {
		return err
	}
	schema, err := r.NewSchema(ctx)
	if err != nil {
		return err
	}
	q := store.New(schema)
	table := outboxTable(schema)

	// 1. The history. Message ids rise with the row (a run prefix, then the row number), as
	// UUIDv7 ids do, so that every index is appended to at its right edge.
	r.logf("loading %d published rows (%d B payloads) into %s", o.rows, o.size, table)
	t0 := time.Now()
	span := 2 * time.Hour
	for from := 0; from < o.rows; from += historyChunk {
		to := min(from+historyChunk, o.rows)
		_, err := r.Admin.Exec(ctx, `INSERT INTO `+table+` (message_id, subject, partition_key, payload, state, created_at, ready_at, published_at, stream, stream_seq)
SELECT (substr(md5($6::text), 1, 8) || lpad(to_hex(i), 24, '0'))::uuid, 'bench.history.msg', hashint4(i::int4) & 2147483647, convert_to(repeat('h', $3::int4), 'UTF8'), 'published',
       t, t, t, 'BENCH_HISTORY', i
FROM generate_series($1::int8, $2::int8 - 1) AS i,
     LATERAL (SELECT now() - $4::float8 * interval '1 millisecond' * (1 - i::float8 / $5::float8)) AS x(t)`,
			from, to, o.size, float64(span.Milliseconds()), float64(o.rows), schema)
		if err != nil {
			return fmt.Errorf("load history: %w", err)
		}
		r.logf("loaded %d/%d (%.0f rows/s)", to, o.rows, float64(to)/time.Since(t0).Seconds())
	}
	if _, err := r.Admin.Exec(ctx, "VACUUM (ANALYZE) "+table); err != nil {
		return err
	}
	var tableBytes, idxBytes, pages int64
	if err := r.Admin.QueryRow(ctx, "SELECT pg_table_size($1::regclass), pg_indexes_size($1::regclass), relpages FROM pg_class WHERE oid = $1::regclass", table).
		Scan(&tableBytes, &idxBytes, &pages); err != nil {
		return err
	}
	r.logf("history loaded and analyzed in %s: table %d MB, indexes %d MB, %d pages", time.Since(t0).Round(time.Second), tableBytes>>20, idxBytes>>20, pages)

	// 2. The live backlog, the ordinary way.
	rows := make([]store.NewRow, o.batch)
	for i := range rows {
		rows[i] = store.NewRow{MessageID: uuid.New(), Subject: "bench.history.msg", Key: fmt.Sprintf("key-%d", i%100), Payload: make([]byte, DefaultPayload)}
	}
	if err := pgx.BeginFunc(ctx, r.Admin, func(tx pgx.Tx) error { return q.InsertMessages(ctx, tx, rows) }); err != nil {
		return err
	}
	conn, err := r.Admin.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	claimArgs := store.ClaimArgs{Limit: o.batch, PartitionCount: relay.DefaultPartitions}
	claimed, err := q.Claim(ctx, conn.Conn(), claimArgs)
	if err != nil {
		return err
	}
	if len(claimed) != o.batch {
		return fmt.Errorf("%w: the claim found %d of the %d ready rows", ErrCheckFailed, len(claimed), o.batch)
	}
	settle := store.SettleArgs{MaxAttempts: relay.DefaultMaxAttempts}
	for i, c := range claimed {
		settle.Published = append(settle.Published, store.Published{ID: c.ID, Stream: "BENCH_HISTORY", Seq: uint64(o.rows + i)})
	}
	retain := settle
	retain.Retain = true
	floorArgs := claimArgs
	floorArgs.After = claimed[0].ID - 1

	type planCase struct {
		name    string
		explain func(generic bool) ([]byte, error)
	}
	cases := []planCase{
		{"claim", func(g bool) ([]byte, error) { return q.ExplainClaim(ctx, conn.Conn(), claimArgs, g) }},
		{"claim_floor", func(g bool) ([]byte, error) { return q.ExplainClaim(ctx, conn.Conn(), floorArgs, g) }},
		{"settle_delete", func(g bool) ([]byte, error) { return q.ExplainSettle(ctx, conn.Conn(), settle, g) }},
		{"settle_retain", func(g bool) ([]byte, error) { return q.ExplainSettle(ctx, conn.Conn(), retain, g) }},
	}
	kv := []any{"rows", o.rows, "table_mb", tableBytes >> 20, "indexes_mb", idxBytes >> 20}
	var bad []string
	bound := int64(historyMaxBuffersPerRow * o.batch)
	for _, c := range cases {
		for _, generic := range []bool{false, true} {
			name := c.name
			if generic {
				name += "_generic"
			}
			js, err := c.explain(generic)
			if err != nil {
				return fmt.Errorf("explain %s: %w", name, err)
			}
			p, err := parsePlan(js)
			if err != nil {
				return fmt.Errorf("explain %s: %w", name, err)
			}
			r.logf("%s: %.2f ms, %d buffers (%.1f per row), nodes: %s", name, p.ms, p.buffers, float64(p.buffers)/float64(o.batch), strings.Join(p.nodes, ", "))
			kv = append(kv, name+"_ms", p.ms, name+"_buffers", p.buffers)
			if p.seqScan {
				bad = append(bad, name+" scans the outbox table sequentially")
			}
			if p.buffers > bound {
				bad = append(bad, fmt.Sprintf("%s reads %d buffers, over %d", name, p.buffers, bound))
			}
		}
	}

	// 3. The purge: the check-back's statement, as its job runs it, for purgeTime.
	var purged int64
	batches := 0
	var firstBatch, lastBatch time.Duration
	pt := time.Now()
	for time.Since(pt) < o.purgeTime {
		b0 := time.Now()
		n, err := q.PurgeMessages(ctx, r.Admin, store.StatePublished, o.retention, checkback.DefaultPurgeBatchSize)
		if err != nil {
			return fmt.Errorf("purge: %w", err)
		}
		d := time.Since(b0)
		if batches == 0 {
			firstBatch = d
		}
		lastBatch = d
		batches++
		purged += n
		if n < int64(checkback.DefaultPurgeBatchSize) {
			break // nothing older than the retention is left
		}
	}
	purgeDur := time.Since(pt)
	purgeRate := float64(purged) / purgeDur.Seconds()
	r.logf("purge: %d rows in %d batches of %d in %s (%.0f rows/s; first batch %s, last %s); the producers publish %.0f rows/s: %.1f×",
		purged, batches, checkback.DefaultPurgeBatchSize, purgeDur.Round(time.Millisecond), purgeRate, firstBatch.Round(time.Microsecond), lastBatch.Round(time.Microsecond), o.rate, purgeRate/o.rate)
	if purgeRate < o.rate {
		bad = append(bad, fmt.Sprintf("the purge deletes %.0f rows/s, slower than the %.0f rows/s published", purgeRate, o.rate))
	}
	verdict := "ok"
	if len(bad) > 0 {
		verdict = "missed"
	}
	kv = append(kv, "purge_rows_per_s", purgeRate, "purge_ratio", purgeRate/o.rate,
		"purge_first_batch_ms", ms(firstBatch), "purge_last_batch_ms", ms(lastBatch), "verdict", verdict, "load1", load1())
	r.result(kv...)
	if len(bad) > 0 {
		return fmt.Errorf("%w: %s", ErrCheckFailed, strings.Join(bad, "; "))
	}
	return nil
}

// plan is what the history check reads from an EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON).
type plan struct {
	ms      float64
	buffers int64 // shared buffers hit and read by the whole statement
	nodes   []string
	seqScan bool // a sequential scan of the outbox table
}

type planNode struct {
	NodeType  string     `json:"Node Type"`
	Relation  string     `json:"Relation Name"`
	Index     string     `json:"Index Name"`
	SharedHit int64      `json:"Shared Hit Blocks"`
	SharedRd  int64      `json:"Shared Read Blocks"`
	Plans     []planNode `json:"Plans"`
}

func parsePlan(js []byte) (plan, error) {
	var doc []struct {
		Plan planNode `json:"Plan"`
		Exec float64  `json:"Execution Time"`
	}
	if err := json.Unmarshal(js, &doc); err != nil || len(doc) != 1 {
		return plan{}, fmt.Errorf("unexpected EXPLAIN output: %v", err)
	}
	p := plan{ms: doc[0].Exec, buffers: doc[0].Plan.SharedHit + doc[0].Plan.SharedRd}
	var walk func(n planNode)
	walk = func(n planNode) {
		d := n.NodeType
		if n.Index != "" {
			d += " using " + n.Index
		} else if n.Relation != "" {
			d += " on " + n.Relation
		}
		p.nodes = append(p.nodes, d)
		if n.NodeType == "Seq Scan" && n.Relation == store.MessagesTable {
			p.seqScan = true
		}
		for _, c := range n.Plans {
			walk(c)
		}
	}
	walk(doc[0].Plan)
	return p, nil
}
