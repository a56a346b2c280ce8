package store

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Plans of the hot path, for `outbox-bench history`: the claim and the settle statements
// exactly as the relay runs them, prepared and executed under EXPLAIN (ANALYZE, BUFFERS,
// FORMAT JSON) with a custom or a generic plan (a prepared statement switches to the generic
// plan after five runs when it is not dearer).

// ExplainClaim explains Claim with a (rows are read, nothing is changed) on conn, with the
// generic plan when generic is set.
func (q *Queries) ExplainClaim(ctx context.Context, conn *pgx.Conn, a ClaimArgs, generic bool) ([]byte, error) {
	count := a.PartitionCount
	if count <= 0 {
		count = 1
	}
	parts := "NULL"
	if a.Partitions != nil {
		parts = int32Array(a.Partitions)
	}
	args := fmt.Sprintf("%d, %s, %d, %s, %d, %s", a.Limit, parts, count, int64Array(a.Exclude), a.After, textArray(a.ExcludeKeys))
	return explainPrepared(ctx, conn, q.claim, args, generic)
}

// ExplainSettle explains Settle with a in a transaction it rolls back, so the rows stay as
// they are.
func (q *Queries) ExplainSettle(ctx context.Context, conn *pgx.Conn, a SettleArgs, generic bool) ([]byte, error) {
	ok := make([]int64, len(a.Published))
	streams := make([]string, len(a.Published))
	seqs := make([]int64, len(a.Published))
	for i, p := range a.Published {
		ok[i], streams[i], seqs[i] = p.ID, p.Stream, int64(p.Seq)
	}
	fIDs := make([]int64, len(a.Failed))
	var fErrs, fDelay, fPerm []string
	for i, f := range a.Failed {
		fIDs[i] = f.ID
		fErrs = append(fErrs, strconv.Quote(ErrorText(f.Err)))
		fDelay = append(fDelay, strconv.FormatFloat(float64(f.Delay)/float64(time.Millisecond), 'f', -1, 64))
		fPerm = append(fPerm, strconv.FormatBool(f.Permanent))
	}
	arr := func(elems []string, typ string) string {
		return "'{" + strings.ReplaceAll(strings.Join(elems, ","), "'", "''") + "}'::" + typ
	}
	args := fmt.Sprintf("%s, %s, %s, %s, %d, %s", int64Array(ok), int64Array(fIDs), arr(fErrs, "text[]"), arr(fDelay, "float8[]"), a.MaxAttempts, arr(fPerm, "bool[]"))
	stmt := q.settleDelete
	if a.Retain {
		var qs []string
		for _, s := range streams {
			qs = append(qs, strconv.Quote(s))
		}
		args += ", " + arr(qs, "text[]") + ", " + int64Array(seqs)
		stmt = q.settleRetain
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	return explainPrepared(ctx, tx.Conn(), stmt, args, generic)
}

func explainPrepared(ctx context.Context, conn *pgx.Conn, stmt, args string, generic bool) ([]byte, error) {
	mode := "force_custom_plan"
	if generic {
		mode = "force_generic_plan"
	}
	var prev string
	if err := conn.QueryRow(ctx, "SELECT current_setting('plan_cache_mode')").Scan(&prev); err != nil {
		return nil, err
	}
	if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode); err != nil {
		return nil, err
	}
	// Back to the session's own value (a relay's session sets one: RESET would drop it).
	defer func() {
		_, _ = conn.Exec(context.WithoutCancel(ctx), "SELECT set_config('plan_cache_mode', $1, false)", prev)
	}()
	if _, err := conn.Exec(ctx, "PREPARE txoutbox_explain AS "+stmt); err != nil {
		return nil, err
	}
	defer func() { _, _ = conn.Exec(context.WithoutCancel(ctx), "DEALLOCATE txoutbox_explain") }()
	var plan []byte
	err := conn.QueryRow(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE txoutbox_explain("+args+")", pgx.QueryExecModeSimpleProtocol).Scan(&plan)
	return plan, err
}

func int64Array(v []int64) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.FormatInt(x, 10)
	}
	return "'{" + strings.Join(s, ",") + "}'::int8[]"
}

// textArray is v as an SQL literal of type text[]: each element quoted as an array element
// (quoteElem), the whole as a string constant.
func textArray(v []string) string {
	lit := arrayLiteral(len(v), func(b *strings.Builder, i int) bool { quoteElem(b, v[i]); return true })
	return "'" + strings.ReplaceAll(lit, "'", "''") + "'::text[]"
}

func int32Array(v []int32) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.FormatInt(int64(x), 10)
	}
	return "'{" + strings.Join(s, ",") + "}'::int4[]"
}

// ExplainScheduledSample explains SampleScheduled with limit on conn (it only reads).
func (q *Queries) ExplainScheduledSample(ctx context.Context, conn *pgx.Conn, limit int, generic bool) ([]byte, error) {
	return explainPrepared(ctx, conn, q.sched.sample, strconv.Itoa(limit), generic)
}

// ExplainScheduledStatus explains ScheduledStatuses with limit on conn (it only reads).
func (q *Queries) ExplainScheduledStatus(ctx context.Context, conn *pgx.Conn, limit int, generic bool) ([]byte, error) {
	return explainPrepared(ctx, conn, q.sched.statusBySubject, strconv.Itoa(limit), generic)
}
