package store

// Delayed messages (migration 005). A message with a delivery time is stored in state
// scheduled. The relay's claim reads the ready index only, so a scheduled row costs it nothing
// however many there are and however far ahead they are due. Before it claims, a relay
// promotes the rows that fell due: an index range scan over (deliver_at, id) WHERE
// state = 'scheduled' that stops at the first row not yet due, so its cost is the number of due
// rows, not the number of scheduled ones. Of each key it takes the earliest scheduled row only,
// so that one key, however many of its rows are due and whether or not it can be promoted
// now, takes one of the PromoteLimit places of a promotion: a key held by a producer's open
// transaction, or whose earliest row an uncommitted cancel holds, does not keep the other
// keys' due rows (and the unkeyed ones) waiting behind it.
//
// Promotion moves each due row to ready with a new id (UPDATE ... SET id = DEFAULT; the rows of
// one key one statement after another, earliest due first: a promotion reports the keys with
// several due rows, and the next one follows its first statement with one statement per
// further row of those keys, in the same round trip and transaction, so that a burst of one
// key is promoted in a few passes, not one row per pass), holding its key's lock as
// EnqueueTx does:
// for one key, id order stays the order in which rows became ready, and a delayed message
// takes its place in its key's order when it falls due. The locks are only tried
// (pg_try_advisory_xact_lock): a row whose key a producer's transaction holds, or that a
// canceller holds (FOR UPDATE SKIP LOCKED), is left for the next pass, so a relay never waits
// on a business transaction.
//
// Cancelling moves the row to rolled_back (settled_by 'cancel'; the check-back purges it after
// the rolled-back retention, and the producer role needs no DELETE) and rescheduling updates
// its time, both only while it is scheduled and in the caller's transaction: they take the row lock, so a promotion under way makes them
// wait for it (and then find the row ready: too late), and a cancel not yet committed makes
// promotion skip the row. A message whose cancel committed was therefore never ready, and the
// relay publishes ready rows only.
//
// Lateness (the relay's histogram) is measured from when a delayed message became due: the
// latest of its delivery time, its insert (created_at), its half message's commit and its
// last RescheduleTx. The last two are in settled_at: the commit of a half message sets it, and
// so does RescheduleTx (the producer role may write the column), so that a time already past
// when the message was committed or moved counts as no lateness. The SQL functions
// txoutbox_reschedule and txoutbox_reschedule_biz_key set it too (since migration 009).

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// dueSQL is when the scheduled row alias became or becomes due: the latest of its delivery
// time, its insert (created_at: the start of the producer's transaction, PostgreSQL's now();
// the database records no commit time) and its half message's commit or last reschedule
// (settled_at). A delivery time already past when the message was committed or moved makes it
// due then, not at that time. The relay's lateness (Claimed.DueAt), the next-due gauge and
// the status page all count from it.
func dueSQL(alias string) string {
	return "greatest(" + alias + ".deliver_at, " + alias + ".created_at, " + alias + ".settled_at)"
}

// overdueScan bounds the rows past their delivery time that the metrics sample reads for the
// earliest due time: a running relay promotes them within its poll interval, so there are
// few; when there are more (no relay runs), the earliest due time among the first
// overdueScan in delivery order stands for all (a later row's due time is at least its
// delivery time, so it is exact unless every one of those became due after it).
const overdueScan = 1000

// BizKeyHeader is the header the business key travels in (outbox.HeaderBizKey); the scheduled
// rows' business key index (migration 005) is on its first value.
const BizKeyHeader = "Txoutbox-Biz-Key"

// PromoteLimit bounds the rows one promotion moves: at most this many key locks (and as many
// shared bucket locks) in one statement, as a producer's KeyLockBudget.
const PromoteLimit = KeyLockBudget

type scheduledSQL struct {
	promote         string
	promoteNext     string
	cancel          string
	cancelBiz       string
	reschedule      string
	rescheduleBiz   string
	state           string
	bizKeyState     string
	sample          string
	list            string
	statusBySubject string
}

func newScheduledSQL(q *Queries) scheduledSQL {
	m := q.Messages
	keyClass := strconv.Itoa(int(q.KeyLockClass)) + "::int4"
	bucketClass := strconv.Itoa(int(q.KeyBucketLockClass)) + "::int4"
	bizKey := `(headers -> '` + BizKeyHeader + `' ->> 0)`
	var s scheduledSQL
	// $1: the most rows to look at. Returns how many moved, how many were looked at (more than
	// moved: call again), the seconds until the next scheduled row not yet due (NULL when there
	// is none), measured on the database's clock, and the keys one of whose rows moved that have
	// more due rows, with the most due rows one of them has (counted up to $1; see promoteNext).
	//
	// A key takes at most one of the $1 places: only its earliest scheduled row is looked at
	// (its later rows never overtake it, and a key whose lock a producer's transaction holds,
	// or whose earliest row a cancel holds, must not fill the window and keep every other due
	// row waiting behind it). The scan reads the due rows in due order up to the $1-th key,
	// with one probe of the key index for each keyed row: a key's later due rows cost a probe
	// each, not a place.
	s.promote = `WITH due AS MATERIALIZED (
  SELECT o.id, o.msg_key, o.partition_key FROM ` + m + ` o
  WHERE o.state = 'scheduled' AND o.deliver_at <= now()
    AND (o.msg_key IS NULL OR NOT EXISTS ( -- its key's earliest scheduled row only (locked or not)
          SELECT 1 FROM ` + m + ` e
          WHERE e.state = 'scheduled' AND e.msg_key = o.msg_key
            AND (e.deliver_at, e.id) < (o.deliver_at, o.id)))
  ORDER BY o.deliver_at, o.id
  LIMIT $1
  FOR UPDATE OF o SKIP LOCKED
), locked AS MATERIALIZED (
  SELECT d.id, d.msg_key FROM due d
  WHERE d.msg_key IS NULL
     OR (pg_try_advisory_xact_lock_shared(` + bucketClass + `, d.partition_key % ` + strconv.Itoa(KeyLockBuckets) + `)
         AND pg_try_advisory_xact_lock(` + keyClass + `, d.partition_key))
), moved AS (
  UPDATE ` + m + ` o SET id = DEFAULT, state = 'ready', ready_at = clock_timestamp(), next_attempt_at = now(), attempts = 0
  FROM locked l WHERE o.id = l.id AND o.state = 'scheduled'
  RETURNING l.msg_key
), busy AS ( -- the statement's snapshot still shows the moved rows scheduled: n counts them
  SELECT coalesce(array_agg(h.msg_key ORDER BY h.msg_key), '{}') AS keys, coalesce(max(h.n), 0) AS most
  FROM (SELECT v.msg_key, (SELECT count(*) FROM (SELECT 1 FROM ` + m + ` e
                             WHERE e.state = 'scheduled' AND e.msg_key = v.msg_key AND e.deliver_at <= now()
                             LIMIT $1) c) AS n
        FROM moved v WHERE v.msg_key IS NOT NULL) h
  WHERE h.n > 1
)
SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM due),
       (SELECT extract(epoch FROM deliver_at - now())::float8 FROM ` + m + `
        WHERE state = 'scheduled' AND deliver_at > now() ORDER BY deliver_at LIMIT 1),
       busy.keys, busy.most,
       -- A promotion commits synchronously (the relay's session has synchronous_commit off):
       -- a row promoted, published and then lost with the commit in a crash would be
       -- scheduled again, and a cancel would then succeed for a message already in the stream.
       CASE WHEN EXISTS (SELECT 1 FROM moved) THEN set_config('synchronous_commit', 'on', true) END
FROM busy`
	// The next due row of each of the keys $1, one statement per row of a key, run after
	// promote in its transaction (PromoteAndClaim): a key with many due rows gets them all
	// promoted in one pass, in due order, instead of one per pass. Per key: its earliest
	// scheduled row, if due, not locked (a cancel), and its key lock is had; nothing of the key
	// otherwise (its later rows never overtake it). Returns how many moved.
	s.promoteNext = `WITH first AS MATERIALIZED (
  SELECT f.id, f.partition_key FROM unnest($1::text[]) AS k(msg_key)
  CROSS JOIN LATERAL (
    SELECT e.id, e.partition_key, e.deliver_at FROM ` + m + ` e
    WHERE e.state = 'scheduled' AND e.msg_key = k.msg_key
    ORDER BY e.deliver_at, e.id
    LIMIT 1) f
  WHERE f.deliver_at <= now()
), rows AS MATERIALIZED (
  SELECT o.id, o.partition_key FROM ` + m + ` o
  WHERE o.id IN (SELECT id FROM first) AND o.state = 'scheduled'
  FOR UPDATE SKIP LOCKED
), locked AS MATERIALIZED (
  SELECT r.id FROM rows r
  WHERE pg_try_advisory_xact_lock_shared(` + bucketClass + `, r.partition_key % ` + strconv.Itoa(KeyLockBuckets) + `)
    AND pg_try_advisory_xact_lock(` + keyClass + `, r.partition_key)
), moved AS (
  UPDATE ` + m + ` o SET id = DEFAULT, state = 'ready', ready_at = clock_timestamp(), next_attempt_at = now(), attempts = 0
  FROM locked l WHERE o.id = l.id AND o.state = 'scheduled'
  RETURNING 1
)
SELECT count(*), CASE WHEN count(*) > 0 THEN set_config('synchronous_commit', 'on', true) END FROM moved` // as promote
	cancel := `UPDATE ` + m + ` SET state = 'rolled_back', settled_by = '` + SettledByCancel + `', settled_at = clock_timestamp()
WHERE `
	s.cancel = cancel + `message_id = $1 AND state = 'scheduled'`
	// The business key forms find the ids in a sub-select, then update by id: under the
	// producer grants' row-level security an UPDATE's own condition may use an index only if
	// its functions are leakproof, which the business key expression's (jsonb -> and ->>) are
	// not, so `WHERE <biz key> = $1` alone scans the whole table for a producer login; the
	// sub-select (whose SELECT policy is true) uses the business key index, the UPDATE the
	// message_id index (uuid = is leakproof).
	byBizKey := `message_id = ANY (ARRAY(SELECT message_id FROM ` + m + ` WHERE ` + bizKey + ` = $1 AND state = 'scheduled'))
  AND state = 'scheduled' RETURNING message_id`
	s.cancelBiz = cancel + byBizKey
	// A reschedule records its time in settled_at (see the top of this file).
	s.reschedule = `UPDATE ` + m + ` SET deliver_at = $2, settled_at = clock_timestamp() WHERE message_id = $1 AND state = 'scheduled'`
	s.rescheduleBiz = `UPDATE ` + m + ` SET deliver_at = $2, settled_at = clock_timestamp() WHERE ` + byBizKey
	s.state = `SELECT state FROM ` + m + ` WHERE message_id = $1`
	// After a business key form changed nothing: the state of the key's latest row that is not
	// scheduled. No index has the business keys of rows in other states (the business key index
	// is on the scheduled rows only), so this reads the outbox's rows; it runs only when nothing
	// was scheduled under the key.
	s.bizKeyState = `SELECT state FROM ` + m + ` WHERE ` + bizKey + ` = $1 AND state <> 'scheduled' ORDER BY id DESC LIMIT 1`
	// Bounded, for the metrics: scheduled rows counted up to $1, and the next due time (see
	// dueSQL): the earliest due of the rows already past their delivery time (the first
	// overdueScan of them in delivery order), else the earliest delivery time to come (a row
	// not yet past it is due then: it was inserted, committed and rescheduled before now).
	// The count reads the scheduled index in its order, so that it never scans the table for
	// its few scheduled rows among many others.
	s.sample = `SELECT (SELECT count(*) FROM (SELECT 1 FROM ` + m + ` WHERE state = 'scheduled' ORDER BY deliver_at LIMIT $1) s),
       (SELECT extract(epoch FROM least(
          (SELECT min(` + dueSQL("o") + `) FROM (SELECT deliver_at, created_at, settled_at FROM ` + m + `
            WHERE state = 'scheduled' AND deliver_at <= now() ORDER BY deliver_at LIMIT ` + strconv.Itoa(overdueScan) + `) o),
          (SELECT deliver_at FROM ` + m + ` WHERE state = 'scheduled' AND deliver_at > now() ORDER BY deliver_at LIMIT 1)) - now())::float8)`
	s.list = `SELECT message_id, subject, coalesce(msg_key, ''), coalesce(` + bizKey + `, ''), deliver_at, ` + dueSQL("o") + `, created_at, coalesce(octet_length(payload), 0),
    attempts, coalesce(last_error, ''), headers
FROM ` + m + ` o
WHERE state = 'scheduled' AND ($1::text = '' OR subject = $1) AND ($2::timestamptz IS NULL OR deliver_at <= $2)
ORDER BY deliver_at, id
LIMIT $3`
	// For relay status and the status page: the first $1 scheduled rows in due order (an
	// index range scan of the scheduled index, bounded however many rows wait), per subject;
	// with the rows counted (up to $1) and the last delivery time (the index read backwards).
	// The first and last times are due times (dueSQL), as the lateness the relay measures.
	s.statusBySubject = `WITH s AS MATERIALIZED (
  SELECT subject, deliver_at, ` + dueSQL("o") + ` AS due FROM ` + m + ` o WHERE state = 'scheduled' ORDER BY deliver_at, id LIMIT $1
)
SELECT s.subject, count(*), min(s.due), max(s.due), count(*) FILTER (WHERE s.deliver_at <= now()),
       (SELECT count(*) FROM s),
       -- The last due time: the last delivery time's row's (a row not yet due is due at its
       -- delivery time), or, when every row is past its delivery time, a later due among those
       -- counted (one committed after its time).
       greatest((SELECT ` + dueSQL("l") + ` FROM ` + m + ` l WHERE state = 'scheduled' ORDER BY deliver_at DESC, id DESC LIMIT 1),
                (SELECT max(due) FROM s))
FROM s GROUP BY s.subject ORDER BY s.subject`
	return s
}

// Promotion is what one Promote did.
type Promotion struct {
	// Moved counts the rows made ready.
	Moved int
	// More says that due rows are left (a full batch, a further due row of a key, a row whose
	// key was locked): promote again.
	More bool
	// Next is how long until the next scheduled row not yet due is due, on the database's
	// clock, when HasNext.
	Next    time.Duration
	HasNext bool
	// Busy are the keys one of whose rows the promotion moved that have more due rows, and
	// Rows the most due rows one of them had (the moved one included, counted up to the
	// promotion's limit): pass them to the next PromoteAndClaim (Follow), which then promotes
	// those keys' rows all in due order instead of one per pass. A key that could not be
	// promoted (held) is not among them: following it would cost a statement a round for
	// nothing.
	Busy []string
	Rows int
}

// Follow is what PromoteAndClaim promotes after its first statement: the next due row of
// each of Keys, Rounds times over, one statement after another (each key's rows in due order).
type Follow struct {
	Keys   []string
	Rounds int
}

// FollowOf is the Follow a promotion calls for: its busy keys, as many rounds as the busiest
// had rows (its first is promoted by the next promotion's first statement), at most
// PromoteLimit, so that one pass moves at most about twice PromoteLimit rows and locks at
// most PromoteLimit keys more.
func FollowOf(p Promotion) Follow {
	if len(p.Busy) == 0 || p.Rows < 2 {
		return Follow{}
	}
	return Follow{Keys: p.Busy, Rounds: min(p.Rows-1, PromoteLimit)}
}

// Promote moves scheduled rows that fell due to ready, looking at up to limit of them (see
// the top of this file). It runs as one statement: pass a pool or a connection outside a
// transaction, so that the key locks it takes end with it.
func (q *Queries) Promote(ctx context.Context, db DBTX, limit int) (Promotion, error) {
	return scanPromotion(db.QueryRow(ctx, q.sched.promote, int32(limit)), limit)
}

func scanPromotion(row pgx.Row, limit int) (Promotion, error) {
	var moved, due int64
	var secs *float64
	var p Promotion
	var most int64
	var syncCommit *string
	if err := row.Scan(&moved, &due, &secs, &p.Busy, &most, &syncCommit); err != nil {
		return Promotion{}, err
	}
	p.Moved, p.More, p.Rows = int(moved), due > moved || due == int64(limit) || most > 1, int(most)
	if secs != nil {
		p.Next, p.HasNext = seconds(*secs), true
	}
	return p, nil
}

// PromoteAndClaim is Promote (looking at up to limit rows), then f.Rounds promotions of the
// next due row of each of f.Keys (the keys with many due rows the last promotion reported:
// FollowOf), then Claim, in one round trip and one implicit transaction: the claim sees the
// rows just promoted, the key locks the promotions took end with it, and each promotion sees
// the rows the one before it moved, so that a key's rows get their new ids in due order.
func (q *Queries) PromoteAndClaim(ctx context.Context, db DBTX, limit int, f Follow, a ClaimArgs) (Promotion, []Claimed, error) {
	b := &pgx.Batch{}
	b.Queue(q.sched.promote, int32(limit))
	if len(f.Keys) > 0 {
		for range f.Rounds {
			b.Queue(q.sched.promoteNext, f.Keys)
		}
	}
	b.Queue(q.claim, a.args()...)
	br := db.SendBatch(ctx, b)
	p, err := scanPromotion(br.QueryRow(), limit)
	if err != nil {
		_ = br.Close()
		return Promotion{}, nil, err
	}
	for range b.Len() - 2 {
		var moved int64
		var syncCommit *string
		if err := br.QueryRow().Scan(&moved, &syncCommit); err != nil {
			_ = br.Close()
			return Promotion{}, nil, err
		}
		p.Moved += int(moved)
	}
	rows, err := br.Query()
	if err != nil {
		_ = br.Close()
		return Promotion{}, nil, err
	}
	claimed, err := scanClaimed(rows, a.Limit)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return Promotion{}, nil, err
	}
	return p, claimed, nil
}

// ScheduledState returns a message's state, or ErrNoRow.
func (q *Queries) ScheduledState(ctx context.Context, db DBTX, id uuid.UUID) (string, error) {
	var st string
	err := db.QueryRow(ctx, q.sched.state, id).Scan(&st)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", ErrNoRow
	}
	return st, err
}

// ScheduledBizKeyState returns the state of the latest message whose business key is bizKey
// among those not scheduled, or ErrNoRow when there is none (see CancelScheduledBizKey).
func (q *Queries) ScheduledBizKeyState(ctx context.Context, db DBTX, bizKey string) (string, error) {
	var st string
	err := db.QueryRow(ctx, q.sched.bizKeyState, bizKey).Scan(&st)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", ErrNoRow
	}
	return st, err
}

// CancelScheduled withdraws the message id (scheduled → rolled_back) if it is scheduled. When it is not, it returns false
// and the message's state (ErrNoRow when there is none), read in a second statement so that,
// under READ COMMITTED, it sees what a promotion the update waited on committed.
func (q *Queries) CancelScheduled(ctx context.Context, db DBTX, id uuid.UUID) (bool, string, error) {
	ct, err := db.Exec(ctx, q.sched.cancel, id)
	if err != nil {
		return false, "", err
	}
	if ct.RowsAffected() == 1 {
		return true, "", nil
	}
	st, err := q.ScheduledState(ctx, db, id)
	return false, st, err
}

// RescheduleScheduled sets the delivery time of the message id if it is scheduled; otherwise
// as CancelScheduled.
func (q *Queries) RescheduleScheduled(ctx context.Context, db DBTX, id uuid.UUID, at time.Time) (bool, string, error) {
	ct, err := db.Exec(ctx, q.sched.reschedule, id, at)
	if err != nil {
		return false, "", err
	}
	if ct.RowsAffected() == 1 {
		return true, "", nil
	}
	st, err := q.ScheduledState(ctx, db, id)
	return false, st, err
}

// ExplainScheduledBizKey returns the plan (EXPLAIN, FORMAT JSON; nothing is changed) of
// CancelScheduledBizKey for bizKey on db, as its role runs it.
func (q *Queries) ExplainScheduledBizKey(ctx context.Context, db DBTX, bizKey string) ([]byte, error) {
	var plan []byte
	err := db.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+q.sched.cancelBiz, bizKey).Scan(&plan)
	return plan, err
}

// CancelScheduledBizKey withdraws every scheduled message whose business key is bizKey and
// returns their ids.
func (q *Queries) CancelScheduledBizKey(ctx context.Context, db DBTX, bizKey string) ([]uuid.UUID, error) {
	return q.collectIDs(ctx, db, q.sched.cancelBiz, bizKey)
}

// RescheduleScheduledBizKey sets the delivery time of every scheduled message whose business
// key is bizKey and returns their ids.
func (q *Queries) RescheduleScheduledBizKey(ctx context.Context, db DBTX, bizKey string, at time.Time) ([]uuid.UUID, error) {
	return q.collectIDs(ctx, db, q.sched.rescheduleBiz, bizKey, at)
}

func (q *Queries) collectIDs(ctx context.Context, db DBTX, sql string, args ...any) ([]uuid.UUID, error) {
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (uuid.UUID, error) {
		var id uuid.UUID
		err := r.Scan(&id)
		return id, err
	})
}

// ScheduledSample is the bounded count of scheduled rows and how long until the earliest is
// due.
type ScheduledSample struct {
	Count int64
	// NextDueSeconds is how long until the earliest scheduled row is due, in seconds on the
	// database's clock (negative: overdue), exact however far ahead it lies; NextDue is the
	// same as a Duration, saturated at the Duration range (about ±292 years). HasNext is
	// false when there is none.
	NextDueSeconds float64
	NextDue        time.Duration
	HasNext        bool
}

// SampleScheduled counts scheduled rows up to limit and reads the earliest delivery time.
func (q *Queries) SampleScheduled(ctx context.Context, db DBTX, limit int) (ScheduledSample, error) {
	var s ScheduledSample
	var secs *float64
	err := db.QueryRow(ctx, q.sched.sample, int64(limit)).Scan(&s.Count, &secs)
	if secs != nil {
		s.NextDueSeconds, s.NextDue, s.HasNext = *secs, durationOf(*secs), true
	}
	return s, err
}

// ScheduledRow is a scheduled message as an operator sees it.
type ScheduledRow struct {
	MessageID uuid.UUID `json:"message_id"`
	Subject   string    `json:"subject"`
	Key       string    `json:"key"`
	BizKey    string    `json:"biz_key"`
	DeliverAt time.Time `json:"deliver_at"`
	// DueAt is when it became or becomes due (see dueSQL): its delivery time, or its insert
	// or last reschedule when that came later.
	DueAt        time.Time `json:"due_at"`
	CreatedAt    time.Time `json:"created_at"`
	PayloadBytes int64     `json:"payload_bytes"`
	Attempts     int32     `json:"attempts"`
	LastError    string    `json:"last_error"`
	Headers      HeaderMap `json:"headers"`
}

// ListScheduled returns up to limit scheduled messages in due order, of subject (any when
// ""), due at or before dueBefore (any when nil).
func (q *Queries) ListScheduled(ctx context.Context, db DBTX, subject string, dueBefore *time.Time, limit int) ([]ScheduledRow, error) {
	rows, err := db.Query(ctx, q.sched.list, subject, dueBefore, int32(limit))
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (ScheduledRow, error) {
		var s ScheduledRow
		err := r.Scan(&s.MessageID, &s.Subject, &s.Key, &s.BizKey, &s.DeliverAt, &s.DueAt, &s.CreatedAt, &s.PayloadBytes,
			&s.Attempts, &s.LastError, &s.Headers)
		return s, err
	})
}

// ScheduledSubject is one subject's scheduled messages among those counted.
type ScheduledSubject struct {
	Subject  string
	Count    int64
	FirstDue time.Time
	LastDue  time.Time
	// Overdue counts those already due (the relay promotes them at its next pass; many of
	// them mean no relay is running).
	Overdue int64
}

// ScheduledStatus is an overview of the scheduled messages, bounded: it reads the first
// limit of them in due order (the scheduled index), however many there are.
type ScheduledStatus struct {
	// Subjects are the subjects of the rows counted. When Capped, there were more rows than
	// counted: each count is a lower bound (the overdue ones come first in due order, so they
	// are exact unless limit of them are overdue), LastDue is the last among those counted,
	// and subjects whose rows all fall due later are missing.
	Subjects []ScheduledSubject
	Counted  int64
	Capped   bool
	// LastDue is the last due time of all scheduled rows: exact when a row is not yet due (the
	// last delivery time), else the last among those counted.
	LastDue time.Time
}

// ScheduledStatuses counts the first limit scheduled messages in due order per subject (see
// ScheduledStatus).
func (q *Queries) ScheduledStatuses(ctx context.Context, db DBTX, limit int) (ScheduledStatus, error) {
	var out ScheduledStatus
	rows, err := db.Query(ctx, q.sched.statusBySubject, int64(limit))
	if err != nil {
		return out, err
	}
	defer rows.Close()
	for rows.Next() {
		var s ScheduledSubject
		if err := rows.Scan(&s.Subject, &s.Count, &s.FirstDue, &s.LastDue, &s.Overdue, &out.Counted, &out.LastDue); err != nil {
			return out, err
		}
		out.Subjects = append(out.Subjects, s)
	}
	out.Capped = out.Counted >= int64(limit)
	return out, rows.Err()
}

// ScheduledStatusSQL is ScheduledStatuses' statement ($1: the limit), for tests that look at
// its plan.
func (q *Queries) ScheduledStatusSQL() string { return q.sched.statusBySubject }

// PromoteSQL is Promote's statement ($1: the limit), for tests that look at its plan.
func (q *Queries) PromoteSQL() string { return q.sched.promote }

// ClaimSQL is Claim's statement, for tests that look at its plan.
func (q *Queries) ClaimSQL() string { return q.claim }
