package store

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// Check modes of a half message: who the check-back asks when the producer never settles it.
const (
	// CheckModeChecker: ask the producer group's checker over NATS.
	CheckModeChecker = "checker"
	// CheckModeFence: the producer's work is in this database; roll the message back under its
	// row lock (a late CommitTx then fails and its business transaction aborts).
	CheckModeFence = "fence"
)

// Who settled a half message (the settled_by column).
const (
	SettledByProducer = "producer"
	SettledByChecker  = "checkback:checker"
	SettledByFence    = "checkback:fence"
	SettledByOperator = "operator"
	// SettledByCancel: a delayed message withdrawn before it fell due (CancelTx; scheduled.go).
	SettledByCancel = "cancel"
)

// SettleableStates are the states a producer or an operator may settle: a check_exhausted row
// still waits for an answer, and the producer's late answer is the authoritative one.
var SettleableStates = []string{StatePrepared, StateCheckExhausted}

// halfSQL holds the half-message and check-back statements of one schema.
type halfSQL struct {
	insertPrepared  string
	lockKey         string
	commit          string
	rollback        string
	state           string
	claimChecks     string
	lockFences      string
	fence           string
	recordCheck     string
	release         string
	staleReady      string
	byGroup         string
	checkedGroups   string
	countHalf       string
	purgePublished  string
	purgeRolledBack string
	purgeDedup      string
	list            string
	resume          string
}

func newHalfSQL(q *Queries) halfSQL {
	m := q.Messages
	var h halfSQL
	h.insertPrepared = `INSERT INTO ` + m + ` (message_id, subject, msg_key, partition_key, headers, payload, state,
    producer_group, check_mode, next_check_at, deliver_at)
VALUES ($1, $2, $3, $4, $5, $6, 'prepared', $7, $8, now() + $9::float8 * interval '1 millisecond', $10)`
	// The key's lock, taken before the new id is drawn (see commit), as EnqueueTx takes it.
	// (Message ids are unique: one key at most, sorted.)
	row := ` FROM ` + m + ` WHERE message_id = $1 AND msg_key IS NOT NULL AND state = ANY($2::text[])`
	h.lockKey = keyLockSQL(q, `ARRAY(SELECT partition_key`+row+`)`,
		`ARRAY(SELECT partition_key % `+strconv.Itoa(KeyLockBuckets)+row+`)`)
	// Committing draws a new id: for one key, id order must be commit order, and the id this
	// row got at prepare time is older than messages of its key committed since. A half
	// message with a delivery time becomes scheduled (it draws its final id when it falls due).
	h.commit = `UPDATE ` + m + ` SET id = DEFAULT, state = CASE WHEN deliver_at IS NULL THEN 'ready' ELSE 'scheduled' END,
    ready_at = CASE WHEN deliver_at IS NULL THEN clock_timestamp() END, next_attempt_at = now(),
    attempts = 0, next_check_at = NULL, settled_by = $2, settled_at = clock_timestamp(),
    check_count = check_count + $4::int4
WHERE message_id = $1 AND state = ANY($3::text[])
RETURNING state`
	h.rollback = `UPDATE ` + m + ` SET state = 'rolled_back', next_check_at = NULL, settled_by = $2, settled_at = clock_timestamp(),
    check_count = check_count + $4::int4
WHERE message_id = $1 AND state = ANY($3::text[])`
	h.state = `SELECT state FROM ` + m + ` WHERE message_id = $1`
	// Claim due checker rows: lease them by moving their next check past the pass, so that a
	// second check-back instance skips them, and no transaction is held open while asking.
	h.claimChecks = `UPDATE ` + m + ` o SET next_check_at = now() + $3::float8 * interval '1 millisecond'
FROM (
  SELECT id FROM ` + m + `
  WHERE state = 'prepared' AND check_mode = 'checker' AND next_check_at <= now()
    AND created_at <= now() - $1::float8 * interval '1 millisecond'
    AND NOT (producer_group = ANY($4::text[]))
  ORDER BY next_check_at
  LIMIT $2
  FOR UPDATE SKIP LOCKED
) due
WHERE o.id = due.id
RETURNING o.id, o.message_id, o.subject, o.msg_key, o.headers, o.producer_group, o.check_count, o.created_at`
	h.lockFences = `SELECT id FROM ` + m + `
WHERE state = 'prepared' AND check_mode = 'fence' AND next_check_at <= now()
  AND created_at <= now() - $1::float8 * interval '1 millisecond'
ORDER BY next_check_at
LIMIT $2
FOR UPDATE SKIP LOCKED`
	h.fence = `UPDATE ` + m + ` SET state = 'rolled_back', next_check_at = NULL, settled_by = '` + SettledByFence + `',
    settled_at = clock_timestamp(), check_count = check_count + 1
WHERE id = ANY($1::int8[]) AND state = 'prepared'
RETURNING message_id`
	h.recordCheck = `UPDATE ` + m + ` SET check_count = check_count + 1, last_error = $2,
    next_check_at = CASE WHEN check_count + 1 >= $4::int4 THEN NULL ELSE now() + $3::float8 * interval '1 millisecond' END,
    state = CASE WHEN check_count + 1 >= $4::int4 THEN 'check_exhausted' ELSE 'prepared' END
WHERE message_id = $1 AND state = 'prepared'
RETURNING state, check_count`
	h.release = `UPDATE ` + m + ` SET next_check_at = now() WHERE message_id = ANY($1::uuid[]) AND state = 'prepared'`
	// Ready rows older than a threshold, counted up to a bound so that a huge backlog costs a
	// bounded scan, and the age of the oldest ready row: the older of the oldest stale row
	// counted and the ready row with the smallest id (ids are drawn when rows become ready,
	// so that is the oldest, except for dead rows requeued by an operator, which keep their
	// id and count their age from the requeue).
	h.staleReady = `SELECT count(*), greatest(
  coalesce(extract(epoch FROM now() - min(t))::float8, 0),
  coalesce((SELECT extract(epoch FROM now() - coalesce(ready_at, created_at))::float8 FROM ` + m + `
     WHERE state = 'ready' ORDER BY id LIMIT 1), 0))
FROM (SELECT coalesce(ready_at, created_at) AS t FROM ` + m + `
      WHERE state = 'ready' AND coalesce(ready_at, created_at) < now() - $1::float8 * interval '1 millisecond'
      LIMIT $2) stale`
	// Open half messages per producer group: prepared (with the oldest and the most checks)
	// and check_exhausted. Both states are few and have partial indexes.
	// The last check error: that of the group's prepared row with the most checks (the one
	// checked longest), else of its newest check_exhausted row.
	h.byGroup = `SELECT coalesce(producer_group, ''),
  count(*) FILTER (WHERE state = 'prepared'),
  count(*) FILTER (WHERE state = 'check_exhausted'),
  coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE state = 'prepared'))::float8, 0),
  coalesce(max(check_count) FILTER (WHERE state = 'prepared'), 0),
  coalesce((array_agg(last_error ORDER BY state = 'prepared' DESC, check_count DESC, id DESC)
    FILTER (WHERE check_count > 0 AND last_error IS NOT NULL))[1], '')
FROM ` + m + ` WHERE state = 'prepared' OR state = 'check_exhausted'
GROUP BY 1 ORDER BY 1 LIMIT $1`
	h.checkedGroups = `SELECT DISTINCT producer_group FROM ` + m + `
WHERE state = 'prepared' AND check_count > 0 AND producer_group = ANY($1::text[])`
	h.countHalf = `SELECT
  (SELECT count(*) FROM (SELECT 1 FROM ` + m + ` WHERE state = 'prepared' LIMIT $1) a),
  (SELECT count(*) FROM (SELECT 1 FROM ` + m + ` WHERE state = 'check_exhausted' LIMIT $1) b)`
	// Retention: short statements over bounded batches, each its own transaction; SKIP LOCKED
	// so that a purge never waits on (or makes wait) anyone else.
	purge := func(state, col string) string {
		return `DELETE FROM ` + m + ` WHERE id IN (
  SELECT id FROM ` + m + `
  WHERE state = '` + state + `' AND ` + col + ` < now() - $1::float8 * interval '1 millisecond'
  LIMIT $2
  FOR UPDATE SKIP LOCKED
)`
	}
	h.purgePublished = purge(StatePublished, "published_at")
	h.purgeRolledBack = purge(StateRolledBack, "settled_at")
	h.purgeDedup = `DELETE FROM ` + q.Dedup + ` WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM ` + q.Dedup + `
  WHERE processed_at < now() - $1::float8 * interval '1 millisecond'
  LIMIT $2
  FOR UPDATE SKIP LOCKED
))`
	h.list = `SELECT id, message_id, subject, coalesce(msg_key, ''), state, coalesce(producer_group, ''), coalesce(check_mode, ''),
    check_count, created_at, next_check_at, coalesce(last_error, ''), attempts, coalesce(octet_length(payload), 0), headers
FROM ` + m + `
WHERE state = ANY($1::text[]) AND ($2::text = '' OR producer_group = $2)
ORDER BY created_at, id
LIMIT $3`
	h.resume = `UPDATE ` + m + ` SET state = 'prepared', check_count = 0, next_check_at = now(), last_error = NULL
WHERE state = 'check_exhausted' AND (message_id = ANY($1::uuid[]) OR ($2 AND ($3::text = '' OR producer_group = $3)))
RETURNING message_id`
	return h
}

// ms is a duration in (fractional) milliseconds, for interval arithmetic in SQL.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// PrepareArgs is a half message to store.
type PrepareArgs struct {
	Row   NewRow
	Group string // producer group; "" for none (fence mode)
	Mode  string // CheckModeChecker or CheckModeFence
	// Immunity delays the first check (next_check_at = now() + Immunity).
	Immunity time.Duration
}

// InsertPrepared stores a half message in state prepared. It takes no key lock: the row draws
// its final id (under the key's lock) when it is committed.
func (q *Queries) InsertPrepared(ctx context.Context, db DBTX, a PrepareArgs) error {
	r := a.Row
	key, part, hdr, payload := r.columns()
	var group *string
	if a.Group != "" {
		g := a.Group
		group = &g
	}
	_, err := db.Exec(ctx, q.half.insertPrepared, r.MessageID, r.Subject, key, part, hdr, payload, group, a.Mode, ms(max(a.Immunity, 0)), r.DeliverAt)
	return err
}

// ErrNoRow: no outbox row has the message id.
var ErrNoRow = errors.New("no such message")

// HalfSettle says how to settle a half message.
type HalfSettle struct {
	MessageID uuid.UUID
	Commit    bool   // commit (to ready) or roll back
	By        string // settled_by
	// From lists the states the row may be settled from (SettleableStates when nil).
	From []string
	// CountCheck adds one to check_count (a check-back answer).
	CountCheck bool
}

// SettleHalf commits or rolls back a half message. tx must be a transaction when committing:
// the key's lock is held until it ends. It reports whether the row was settled and, when it
// was not, the state the row is in (ErrNoRow when there is none).
//
// Committing locks the key as InsertMessages does (keylock.go: exact or bucket mode, counted
// in the transaction's budget) and then draws a new id, so that for one key id order is commit
// order, as with EnqueueTx.
func (q *Queries) SettleHalf(ctx context.Context, tx DBTX, a HalfSettle) (settled bool, state string, err error) {
	from := a.From
	if from == nil {
		from = SettleableStates
	}
	inc := int32(0)
	if a.CountCheck {
		inc = 1
	}
	if a.Commit {
		b := &pgx.Batch{}
		b.Queue(q.half.lockKey, a.MessageID, from)
		b.Queue(q.half.commit, a.MessageID, a.By, from, inc)
		br := tx.SendBatch(ctx, b)
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			return false, "", fmt.Errorf("lock key: %w", lockTableFull(err))
		}
		var st string
		err := br.QueryRow().Scan(&st)
		if cerr := br.Close(); err == nil || errors.Is(err, pgx.ErrNoRows) && cerr != nil {
			err = cerr
		}
		switch {
		case err == nil:
			return true, st, nil // ready, or scheduled for a message with a delivery time
		case !errors.Is(err, pgx.ErrNoRows):
			return false, "", lockTableFull(err)
		}
	} else {
		ct, err := tx.Exec(ctx, q.half.rollback, a.MessageID, a.By, from, inc)
		if err != nil {
			return false, "", err
		}
		if ct.RowsAffected() == 1 {
			return true, StateRolledBack, nil
		}
	}
	// Not settled: say why. A separate statement, so that under READ COMMITTED it sees what a
	// concurrent settle (whose row lock the update waited on) committed.
	st, err := q.HalfState(ctx, tx, a.MessageID)
	return false, st, err
}

// HalfState returns a message's state, or ErrNoRow.
func (q *Queries) HalfState(ctx context.Context, db DBTX, id uuid.UUID) (string, error) {
	var st string
	err := db.QueryRow(ctx, q.half.state, id).Scan(&st)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", ErrNoRow
	}
	return st, err
}

// HalfRow is a half message as the check-back and the operator see it.
type HalfRow struct {
	ID          int64
	MessageID   uuid.UUID
	Subject     string
	Key         string
	Headers     []byte
	State       string
	Group       string
	Mode        string
	CheckCount  int32
	CreatedAt   time.Time
	NextCheckAt *time.Time
	LastError   string
	// Attempts and PayloadBytes are read by ListHalf only.
	Attempts     int32
	PayloadBytes int64
}

// ClaimChecks leases up to limit checker-mode rows prepared longer than timeout whose next
// check is due, outside the skip groups, moving their next check lease into the future.
func (q *Queries) ClaimChecks(ctx context.Context, db DBTX, timeout time.Duration, limit int, lease time.Duration, skip []string) ([]HalfRow, error) {
	if skip == nil {
		skip = []string{}
	}
	rows, err := db.Query(ctx, q.half.claimChecks, ms(timeout), limit, ms(lease), skip)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []HalfRow
	for rows.Next() {
		var r HalfRow
		var key, group *string
		if err := rows.Scan(&r.ID, &r.MessageID, &r.Subject, &key, &r.Headers, &group, &r.CheckCount, &r.CreatedAt); err != nil {
			return nil, err
		}
		if key != nil {
			r.Key = *key
		}
		if group != nil {
			r.Group = *group
		}
		r.State, r.Mode = StatePrepared, CheckModeChecker
		out = append(out, r)
	}
	return out, rows.Err()
}

// LockFences locks (FOR UPDATE SKIP LOCKED) up to limit fence-mode rows prepared longer than
// timeout whose next check is due. tx must be a transaction; the rows stay locked until it ends.
// A row whose CommitTx is in flight is locked by it and skipped.
func (q *Queries) LockFences(ctx context.Context, tx DBTX, timeout time.Duration, limit int) ([]int64, error) {
	rows, err := tx.Query(ctx, q.half.lockFences, ms(timeout), limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int64])
}

// Fence rolls back the given rows that are still prepared and returns their message ids.
func (q *Queries) Fence(ctx context.Context, tx DBTX, ids []int64) ([]uuid.UUID, error) {
	rows, err := tx.Query(ctx, q.half.fence, ids)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
}

// RecordCheck counts an inconclusive check of a still-prepared row: the next check is due after
// delay, or, when this was check number maxChecks, the row becomes check_exhausted. It returns
// the row's new state and check count; ok is false when the row is no longer prepared.
func (q *Queries) RecordCheck(ctx context.Context, db DBTX, id uuid.UUID, detail string, delay time.Duration, maxChecks int) (state string, count int32, ok bool, err error) {
	// detail quotes the checker (its error text, its reply): made storable here, so that a
	// NUL, invalid UTF-8 or a cut character can never make recording the check fail.
	err = db.QueryRow(ctx, q.half.recordCheck, id, ErrorText(detail), ms(delay), int32(maxChecks)).Scan(&state, &count)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", 0, false, nil
	}
	return state, count, err == nil, err
}

// ReleaseChecks makes claimed rows that were not asked due again at once.
func (q *Queries) ReleaseChecks(ctx context.Context, db DBTX, ids []uuid.UUID) error {
	_, err := db.Exec(ctx, q.half.release, uuidArray(ids))
	return err
}

// StaleReady counts (up to limit) ready rows that became ready more than olderThan ago, and
// returns the age of the oldest ready row (zero when there is none).
func (q *Queries) StaleReady(ctx context.Context, db DBTX, olderThan time.Duration, limit int) (int64, time.Duration, error) {
	var n int64
	var age float64
	if err := db.QueryRow(ctx, q.half.staleReady, ms(olderThan), limit).Scan(&n, &age); err != nil {
		return 0, 0, err
	}
	return n, seconds(age), nil
}

// CountHalf counts (each up to limit) prepared and check_exhausted rows.
func (q *Queries) CountHalf(ctx context.Context, db DBTX, limit int) (prepared, exhausted int64, err error) {
	err = db.QueryRow(ctx, q.half.countHalf, limit).Scan(&prepared, &exhausted)
	return
}

// PurgeMessages deletes up to limit rows in state (published or rolled_back) that were
// published (or settled) more than olderThan ago, and returns how many it deleted.
func (q *Queries) PurgeMessages(ctx context.Context, db DBTX, state string, olderThan time.Duration, limit int) (int64, error) {
	stmt := q.half.purgePublished
	switch state {
	case StatePublished:
	case StateRolledBack:
		stmt = q.half.purgeRolledBack
	default:
		return 0, fmt.Errorf("store: purge of state %q is not supported", state)
	}
	ct, err := db.Exec(ctx, stmt, ms(olderThan), limit)
	return ct.RowsAffected(), err
}

// PurgeDedup deletes up to limit consumer dedup rows processed more than olderThan ago.
func (q *Queries) PurgeDedup(ctx context.Context, db DBTX, olderThan time.Duration, limit int) (int64, error) {
	ct, err := db.Exec(ctx, q.half.purgeDedup, ms(olderThan), limit)
	return ct.RowsAffected(), err
}

// GroupHalf is the open half messages of one producer group.
type GroupHalf struct {
	Group          string
	Prepared       int64
	Exhausted      int64
	OldestPrepared time.Duration
	MaxChecks      int32 // the most checks a prepared row of the group has had
	// LastError is the outcome and detail of the group's last inconclusive check (see
	// byGroup), e.g. "no_responders: no checker serves txoutbox.check.payments"; "" when
	// none was checked.
	LastError string
}

// HalfByGroup returns the open half messages of up to limit producer groups, by group name.
func (q *Queries) HalfByGroup(ctx context.Context, db DBTX, limit int) ([]GroupHalf, error) {
	rows, err := db.Query(ctx, q.half.byGroup, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []GroupHalf
	for rows.Next() {
		var g GroupHalf
		var oldest float64
		if err := rows.Scan(&g.Group, &g.Prepared, &g.Exhausted, &oldest, &g.MaxChecks, &g.LastError); err != nil {
			return nil, err
		}
		g.OldestPrepared = seconds(oldest)
		out = append(out, g)
	}
	return out, rows.Err()
}

// CheckedGroups returns the groups among groups that have a prepared row checked at least
// once (a row a check found inconclusive and nothing has settled since).
func (q *Queries) CheckedGroups(ctx context.Context, db DBTX, groups []string) ([]string, error) {
	rows, err := db.Query(ctx, q.half.checkedGroups, groups)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// ListHalf returns up to limit rows in the given states (of group, unless ""), oldest first,
// with their attempts, payload size and headers.
func (q *Queries) ListHalf(ctx context.Context, db DBTX, states []string, group string, limit int) ([]HalfRow, error) {
	rows, err := db.Query(ctx, q.half.list, states, group, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []HalfRow
	for rows.Next() {
		var r HalfRow
		if err := rows.Scan(&r.ID, &r.MessageID, &r.Subject, &r.Key, &r.State, &r.Group, &r.Mode, &r.CheckCount, &r.CreatedAt, &r.NextCheckAt, &r.LastError,
			&r.Attempts, &r.PayloadBytes, &r.Headers); err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

// Resume makes check_exhausted rows prepared again with a fresh check count, due at once: the
// given ids, or, when all is set, every exhausted row (of group, unless ""). It returns the
// message ids it resumed.
func (q *Queries) Resume(ctx context.Context, db DBTX, ids []uuid.UUID, all bool, group string) ([]uuid.UUID, error) {
	rows, err := db.Query(ctx, q.half.resume, uuidArray(ids), all, group)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
}
