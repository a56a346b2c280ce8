package store

import (
	"context"
	"errors"
	"fmt"
	"math"
	"regexp"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// RelaysTable is the relay membership table (migration 002), unqualified.
const RelaysTable = "txoutbox_relays"

// opsQueries are the statements of relay membership, metric sampling and the admin commands.
type opsQueries struct {
	relays string // quoted, schema-qualified

	register, members, locks, fence, unregister, cleanup string
	memberMark                                           string
	tryLock, unlock                                      string

	samplePartitions, sampleStates, sampleSubjects string
	subjectStatus, partitionStatus                 string

	deadList, deadRequeue, deadPurge string
	blocked                          string
}

func newOpsQueries(q *Queries) *opsQueries {
	o := &opsQueries{relays: pgx.Identifier{q.Schema, RelaysTable}.Sanitize()}
	m := q.Messages
	// The heartbeat is an upsert, so a row removed by cleanup (or a reconnect, which changes
	// the backend pid) simply comes back. started_at is kept: it orders the fair shares.
	// The fleet columns (migration 006) ride along: version, health, NATS state, throughput.
	o.register = `INSERT INTO ` + o.relays + ` AS r (instance, relay_id, backend_pid, partitions, lease_interval_ms, started_at, heartbeat_at,
    version, health, nats_state, published, publish_rate)
VALUES ($1, $2, pg_backend_pid(), $3, $4, now(), now(), $5, $6, $7, $8, $9)
ON CONFLICT (instance) DO UPDATE
SET relay_id = EXCLUDED.relay_id, backend_pid = EXCLUDED.backend_pid, partitions = EXCLUDED.partitions,
    lease_interval_ms = EXCLUDED.lease_interval_ms, heartbeat_at = now(),
    version = EXCLUDED.version, health = EXCLUDED.health, nats_state = EXCLUDED.nats_state,
    published = EXCLUDED.published, publish_rate = EXCLUDED.publish_rate`
	// A member is alive while its lease session exists (its locks die with it, at the same
	// moment) and its heartbeat is not stale (a recycled pid, a frozen process).
	o.members = `SELECT r.instance, r.relay_id, r.backend_pid, r.partitions, r.lease_interval_ms, r.started_at, r.heartbeat_at,
       r.version, r.health, r.nats_state, r.published, r.publish_rate,
       EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = r.backend_pid)
         AND r.heartbeat_at > now() - greatest(r.lease_interval_ms * 10, 30000) * interval '1 millisecond'
FROM ` + o.relays + ` r
ORDER BY r.started_at, r.instance`
	// Partition leases are session advisory locks (two-int form: classid = class,
	// objid = partition, objsubid = 2) in this database.
	o.locks = `SELECT l.objid::int8::int4, l.pid
FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.classid = $1::int8::oid
  AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
ORDER BY 1`
	// Fence a member whose session lives on but whose heartbeat the fencing relay has watched
	// unchanged for long (a frozen or hung process): end its session, so its locks (its
	// partitions) are released. The relay measures the silence on its own monotonic clock
	// (see relay/lease.go); here it is checked again, atomically, that the heartbeat is still
	// the one it watched ($3), that the session lives and holds partition locks (only relays'
	// lease sessions take them, so a reused pid is a live relay's, or holds none), and that
	// no member with a recent heartbeat uses that pid.
	o.fence = `SELECT pg_terminate_backend(r.backend_pid) FROM ` + o.relays + ` r
WHERE r.instance = $1
  AND r.heartbeat_at = $3
  AND EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = r.backend_pid)
  AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = r.backend_pid AND l.locktype = 'advisory' AND l.granted
      AND l.objsubid = 2 AND l.classid = $2::int8::oid)
  AND NOT EXISTS (SELECT 1 FROM ` + o.relays + ` f WHERE f.backend_pid = r.backend_pid AND f.instance <> r.instance
      AND f.heartbeat_at > now() - greatest(f.lease_interval_ms * 10, 30000) * interval '1 millisecond')`
	// What a busy relay watches between its lease rounds (see relay/lease.go): a member that
	// joins or leaves changes it. The table holds a row per relay: this is cheap.
	o.memberMark = `SELECT count(*), coalesce(max(started_at), 'epoch') FROM ` + o.relays
	o.unregister = `DELETE FROM ` + o.relays + ` WHERE instance = $1`
	o.cleanup = `DELETE FROM ` + o.relays + ` WHERE heartbeat_at < now() - $1::float8 * interval '1 second'`
	o.tryLock = `SELECT p FROM unnest($2::int4[]) AS u(p) WHERE pg_try_advisory_lock($1::int4, p)`
	o.unlock = `SELECT p FROM unnest($2::int4[]) AS u(p) WHERE pg_advisory_unlock($1::int4, p)`

	// Sampling for metrics: bounded by $2 rows taken in id order from the ready index, so
	// its cost does not grow with the backlog.
	o.samplePartitions = `SELECT s.p, count(*), extract(epoch FROM now() - min(s.ready))::float8
FROM (SELECT o.partition_key % $1::int4 AS p, coalesce(o.ready_at, o.created_at) AS ready
      FROM ` + m + ` o WHERE o.state = 'ready' ORDER BY o.id LIMIT $2) s
GROUP BY s.p`
	o.sampleSubjects = `SELECT s.subject, count(*), extract(epoch FROM now() - min(s.ready))::float8
FROM (SELECT o.subject, coalesce(o.ready_at, o.created_at) AS ready
      FROM ` + m + ` o WHERE o.state = 'ready' ORDER BY o.id LIMIT $1) s
GROUP BY s.subject
ORDER BY 2 DESC, 1
LIMIT $2`
	capped := func(state string) string {
		return `(SELECT count(*) FROM (SELECT 1 FROM ` + m + ` WHERE state = '` + state + `' LIMIT $1) s)`
	}
	o.sampleStates = `SELECT ` + capped(StateReady) + `, ` + capped(StateDead) + `, ` + capped(StatePrepared) + `, ` + capped(StateCheckExhausted) + `,
       (SELECT extract(epoch FROM now() - coalesce(ready_at, created_at))::float8 FROM ` + m + ` WHERE state = 'ready' ORDER BY id LIMIT 1)`

	// Status (on demand, exact).
	o.subjectStatus = `SELECT subject,
       count(*) FILTER (WHERE state = 'ready'),
       count(*) FILTER (WHERE state = 'ready' AND next_attempt_at <= now()),
       count(*) FILTER (WHERE state = 'ready' AND attempts > 0),
       extract(epoch FROM now() - min(coalesce(ready_at, created_at)) FILTER (WHERE state = 'ready'))::float8,
       count(*) FILTER (WHERE state = 'dead'),
       count(*) FILTER (WHERE state = 'prepared'),
       count(*) FILTER (WHERE state = 'check_exhausted')
FROM ` + m + `
-- Spelled out as ORs so that the planner can OR the partial indexes together instead of
-- scanning the whole table (retained published rows included).
WHERE state = 'ready' OR state = 'dead' OR state = 'prepared' OR state = 'check_exhausted'
GROUP BY subject
ORDER BY subject`
	o.partitionStatus = `SELECT partition_key % $1::int4, count(*), extract(epoch FROM now() - min(coalesce(ready_at, created_at)))::float8
FROM ` + m + ` WHERE state = 'ready'
GROUP BY 1 ORDER BY 1`

	// Keys held back by a dead row: per key, its first dead row and the ready rows after it
	// (which the relay does not claim while it is dead). One pass over the ready rows joined
	// to the (few) dead keyed rows.
	o.blocked = `WITH dead AS (
  SELECT DISTINCT ON (msg_key) msg_key, id, message_id, subject, attempts, coalesce(last_error, '') AS last_error, created_at
  FROM ` + m + ` WHERE state = 'dead' AND msg_key IS NOT NULL
  ORDER BY msg_key, id
)
SELECT d.msg_key, d.message_id, d.subject, d.attempts, d.last_error, d.created_at, count(*)
FROM dead d JOIN ` + m + ` r ON r.msg_key = d.msg_key AND r.state = 'ready' AND r.id > d.id
GROUP BY d.msg_key, d.message_id, d.subject, d.attempts, d.last_error, d.created_at
ORDER BY count(*) DESC, d.msg_key
LIMIT $1`

	// Dead rows. Filters are parameters; NULL means "any".
	deadWhere := `o.state = 'dead'
  AND ($1::text IS NULL OR o.subject ~ $1::text)
  AND ($2::float8 IS NULL OR o.created_at <= now() - $2::float8 * interval '1 second')
  AND ($3::float8 IS NULL OR o.created_at >= now() - $3::float8 * interval '1 second')
  AND ($4::uuid[] IS NULL OR o.message_id = ANY($4::uuid[]))`
	pick := `SELECT o.id FROM ` + m + ` o WHERE ` + deadWhere + ` ORDER BY o.id LIMIT $5`
	o.deadList = `SELECT o.id, o.message_id, o.subject, o.msg_key, o.attempts, coalesce(o.last_error, ''), o.created_at,
       length(o.payload), o.headers
FROM ` + m + ` o WHERE ` + deadWhere + ` ORDER BY o.id LIMIT $5`
	// Requeue: ready again, with a clean slate, due now. The row keeps its id, so it goes out
	// before the later messages of its key that it was holding back.
	o.deadRequeue = `UPDATE ` + m + ` SET state = 'ready', attempts = 0, last_error = NULL, next_attempt_at = now(), ready_at = now()
WHERE id IN (` + pick + `) AND state = 'dead'
RETURNING message_id`
	o.deadPurge = `DELETE FROM ` + m + ` WHERE id IN (` + pick + `) AND state = 'dead' RETURNING message_id`
	return o
}

// RelayRegistration is what a relay says about itself in the membership table.
type RelayRegistration struct {
	Instance      uuid.UUID
	RelayID       string
	Partitions    int
	LeaseInterval time.Duration
	RelayInfo
}

// RelayInfo is what a relay reports with each heartbeat for the fleet view (migration 006).
type RelayInfo struct {
	// Version is the relay's txoutbox version.
	Version string `json:"version"`
	// Health is its state (relay.Health).
	Health string `json:"health"`
	// NATS is the state of its NATS connection (nats.Status: CONNECTED, RECONNECTING, ...).
	NATS string `json:"nats_state"`
	// Published counts the rows this relay process published; PublishRate is its rate per
	// second over about the last minute.
	Published   int64   `json:"published"`
	PublishRate float64 `json:"publish_rate"`
}

func (r *RelayRegistration) args() []any {
	return []any{r.Instance, r.RelayID, int32(r.Partitions), int32(r.LeaseInterval / time.Millisecond),
		r.Version, r.Health, r.NATS, r.Published, r.PublishRate}
}

// RelayMember is a row of the membership table.
type RelayMember struct {
	Instance      uuid.UUID     `json:"instance"`
	RelayID       string        `json:"relay_id"`
	PID           int32         `json:"backend_pid"`
	Partitions    int           `json:"partitions"`
	LeaseInterval time.Duration `json:"-"`
	StartedAt     time.Time     `json:"started_at"`
	HeartbeatAt   time.Time     `json:"heartbeat_at"`
	// RelayInfo is what it reported with its last heartbeat (empty for relays older than
	// migration 006).
	RelayInfo
	// Alive: its lease session exists and its heartbeat is recent.
	Alive bool `json:"alive"`
}

// PartitionLock is a held partition lease: the partition and the backend holding it.
type PartitionLock struct {
	Partition int32
	PID       int32
}

// Membership is one consistent look at the relays and the partition leases.
type Membership struct {
	Members []RelayMember // ordered by started_at, instance
	Locks   []PartitionLock
}

// RegisterRelay inserts or refreshes the relay's membership row. Run it on the lease
// connection: the row records that session's backend pid.
func (q *Queries) RegisterRelay(ctx context.Context, db DBTX, r RelayRegistration) error {
	_, err := db.Exec(ctx, q.ops.register, r.args()...)
	return err
}

// FenceRelay ends the lease session of the member instance if its heartbeat is still
// heartbeat (the value the caller has watched unchanged for long) while its session lives on
// and holds partition locks; it reports whether it did.
func (q *Queries) FenceRelay(ctx context.Context, db DBTX, instance uuid.UUID, heartbeat time.Time) (bool, error) {
	var ok bool
	err := db.QueryRow(ctx, q.ops.fence, instance, int64(q.PartitionLockClass), heartbeat).Scan(&ok)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return ok, err
}

// Membership reads the members and the partition leases; with heartbeat set it first
// refreshes that relay's row, all in one round trip.
func (q *Queries) Membership(ctx context.Context, db DBTX, heartbeat *RelayRegistration) (Membership, error) {
	b := &pgx.Batch{}
	if heartbeat != nil {
		b.Queue(q.ops.register, heartbeat.args()...)
	}
	b.Queue(q.ops.members)
	b.Queue(q.ops.locks, int64(q.PartitionLockClass))
	br := db.SendBatch(ctx, b)
	defer br.Close()
	var out Membership
	if heartbeat != nil {
		if _, err := br.Exec(); err != nil {
			return out, fmt.Errorf("heartbeat: %w", err)
		}
	}
	rows, err := br.Query()
	if err != nil {
		return out, fmt.Errorf("members: %w", err)
	}
	for rows.Next() {
		var m RelayMember
		var part, leaseMS int32
		if err := rows.Scan(&m.Instance, &m.RelayID, &m.PID, &part, &leaseMS, &m.StartedAt, &m.HeartbeatAt,
			&m.Version, &m.Health, &m.NATS, &m.Published, &m.PublishRate, &m.Alive); err != nil {
			rows.Close()
			return out, fmt.Errorf("members: %w", err)
		}
		m.Partitions, m.LeaseInterval = int(part), time.Duration(leaseMS)*time.Millisecond
		out.Members = append(out.Members, m)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return out, fmt.Errorf("members: %w", err)
	}
	rows, err = br.Query()
	if err != nil {
		return out, fmt.Errorf("partition locks: %w", err)
	}
	for rows.Next() {
		var l PartitionLock
		if err := rows.Scan(&l.Partition, &l.PID); err != nil {
			rows.Close()
			return out, fmt.Errorf("partition locks: %w", err)
		}
		out.Locks = append(out.Locks, l)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return out, fmt.Errorf("partition locks: %w", err)
	}
	return out, br.Close()
}

// MemberMark returns the number of rows of the membership table and the latest start among
// them: a relay that joins or leaves changes it.
func (q *Queries) MemberMark(ctx context.Context, db DBTX) (n int64, newest time.Time, err error) {
	err = db.QueryRow(ctx, q.ops.memberMark).Scan(&n, &newest)
	return n, newest, err
}

// UnregisterRelay deletes the relay's membership row (graceful shutdown).
func (q *Queries) UnregisterRelay(ctx context.Context, db DBTX, instance uuid.UUID) error {
	_, err := db.Exec(ctx, q.ops.unregister, instance)
	return err
}

// CleanupRelays deletes membership rows whose heartbeat is older than age.
func (q *Queries) CleanupRelays(ctx context.Context, db DBTX, age time.Duration) (int64, error) {
	tag, err := db.Exec(ctx, q.ops.cleanup, age.Seconds())
	return tag.RowsAffected(), err
}

// TryLockPartitions tries to take the lease of each partition (session advisory locks, on
// db's session) and returns those it got.
func (q *Queries) TryLockPartitions(ctx context.Context, db DBTX, parts []int32) ([]int32, error) {
	return q.int32s(ctx, db, q.ops.tryLock, q.PartitionLockClass, parts)
}

// UnlockPartitions releases the leases of parts held by db's session and returns those
// released.
func (q *Queries) UnlockPartitions(ctx context.Context, db DBTX, parts []int32) ([]int32, error) {
	return q.int32s(ctx, db, q.ops.unlock, q.PartitionLockClass, parts)
}

func (q *Queries) int32s(ctx context.Context, db DBTX, sql string, args ...any) ([]int32, error) {
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int32])
}

// PartitionSample is the ready backlog of one partition.
type PartitionSample struct {
	Partition int32         `json:"partition"`
	Ready     int64         `json:"ready"`
	Oldest    time.Duration `json:"-"` // age of its oldest ready row
}

// SamplePartitions groups the oldest limit ready rows (in id order) by partition: a bounded
// query for metrics. Counts are exact while the whole backlog is below limit.
func (q *Queries) SamplePartitions(ctx context.Context, db DBTX, partitions int, limit int) ([]PartitionSample, error) {
	return q.partitionRows(ctx, db, q.ops.samplePartitions, int32(partitions), int64(limit))
}

// PartitionBacklog is the exact ready backlog per partition (for status views).
func (q *Queries) PartitionBacklog(ctx context.Context, db DBTX, partitions int) ([]PartitionSample, error) {
	return q.partitionRows(ctx, db, q.ops.partitionStatus, int32(partitions))
}

func (q *Queries) partitionRows(ctx context.Context, db DBTX, sql string, args ...any) ([]PartitionSample, error) {
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []PartitionSample
	for rows.Next() {
		var s PartitionSample
		var age float64
		if err := rows.Scan(&s.Partition, &s.Ready, &age); err != nil {
			return nil, err
		}
		s.Oldest = seconds(age)
		out = append(out, s)
	}
	return out, rows.Err()
}

// SubjectSample is the ready backlog of one subject.
type SubjectSample struct {
	Subject string
	Ready   int64
	Oldest  time.Duration // age of its oldest ready row
}

// SampleSubjects groups the oldest limit ready rows (in id order) by subject and returns the
// top subjects with the most: a bounded query for metrics.
func (q *Queries) SampleSubjects(ctx context.Context, db DBTX, limit, top int) ([]SubjectSample, error) {
	rows, err := db.Query(ctx, q.ops.sampleSubjects, int64(limit), int64(top))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []SubjectSample
	for rows.Next() {
		var s SubjectSample
		var age float64
		if err := rows.Scan(&s.Subject, &s.Ready, &age); err != nil {
			return nil, err
		}
		s.Oldest = seconds(age)
		out = append(out, s)
	}
	return out, rows.Err()
}

// StateCounts are row counts by state, each counted up to a limit.
type StateCounts struct {
	Ready, Dead, Prepared, CheckExhausted int64
	// OldestReady is the age of the oldest ready row (by id); zero when there is none.
	OldestReady time.Duration
}

// SampleStates counts rows by state, each up to limit (partial indexes keep it cheap), and
// the age of the oldest ready row.
func (q *Queries) SampleStates(ctx context.Context, db DBTX, limit int) (StateCounts, error) {
	var c StateCounts
	var age *float64
	err := db.QueryRow(ctx, q.ops.sampleStates, int64(limit)).Scan(&c.Ready, &c.Dead, &c.Prepared, &c.CheckExhausted, &age)
	if age != nil {
		c.OldestReady = seconds(*age)
	}
	return c, err
}

// SubjectStatus is one subject's rows that are not yet published.
type SubjectStatus struct {
	Subject        string        `json:"subject"`
	Ready          int64         `json:"ready"`
	Due            int64         `json:"due"`      // ready and due now
	Retrying       int64         `json:"retrying"` // ready after at least one failed publish
	OldestReady    time.Duration `json:"-"`
	Dead           int64         `json:"dead"`
	Prepared       int64         `json:"prepared"`
	CheckExhausted int64         `json:"check_exhausted"`
}

// SubjectStatuses counts unpublished rows per subject (exact: it reads every such row).
func (q *Queries) SubjectStatuses(ctx context.Context, db DBTX) ([]SubjectStatus, error) {
	rows, err := db.Query(ctx, q.ops.subjectStatus)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []SubjectStatus
	for rows.Next() {
		var s SubjectStatus
		var age *float64
		if err := rows.Scan(&s.Subject, &s.Ready, &s.Due, &s.Retrying, &age, &s.Dead, &s.Prepared, &s.CheckExhausted); err != nil {
			return nil, err
		}
		if age != nil {
			s.OldestReady = seconds(*age)
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// seconds is an age in seconds as a Duration: never negative (a clock step makes no age) and
// saturated at the Duration range (see durationOf).
func seconds(s float64) time.Duration {
	if s < 0 {
		return 0
	}
	return durationOf(s)
}

// durationOf is s seconds as a Duration, saturated at the Duration range (about ±292 years):
// a delivery time may lie up to outbox.MaxDeliverAt (9999-12-31), and converting the seconds
// to it from now directly would overflow (a float-to-integer conversion out of range is
// undefined in Go; on amd64 it gives math.MinInt64, a time 292 years in the past). NaN is 0.
func durationOf(s float64) time.Duration {
	ns := s * float64(time.Second)
	switch {
	case ns != ns: // NaN
		return 0
	case ns >= math.MaxInt64: // 2^63 as a float64: out of range
		return math.MaxInt64
	case ns <= math.MinInt64:
		return math.MinInt64
	}
	return time.Duration(ns)
}

// ErrInvalidFilter: a dead-row filter is malformed.
var ErrInvalidFilter = errors.New("invalid filter")

// DeadFilter selects dead rows. Zero fields match everything.
type DeadFilter struct {
	// Subject is a NATS subject, wildcards allowed (orders.*, orders.>).
	Subject string
	// OlderThan / NewerThan bound the row's age (since it was enqueued).
	OlderThan, NewerThan time.Duration
	// IDs are message ids.
	IDs []uuid.UUID
	// Limit bounds how many rows are listed or changed; 0 means no limit.
	Limit int
}

func (f DeadFilter) args() ([]any, error) {
	var subj, older, newer, ids, limit any
	if f.Subject != "" {
		re, err := SubjectRegexp(f.Subject)
		if err != nil {
			return nil, err
		}
		subj = re
	}
	if f.OlderThan < 0 || f.NewerThan < 0 || f.Limit < 0 {
		return nil, fmt.Errorf("%w: ages and limits must not be negative", ErrInvalidFilter)
	}
	if f.OlderThan > 0 {
		older = f.OlderThan.Seconds()
	}
	if f.NewerThan > 0 {
		newer = f.NewerThan.Seconds()
	}
	if len(f.IDs) > 0 {
		ids = uuidArray(f.IDs)
	}
	if f.Limit > 0 {
		limit = int64(f.Limit)
	}
	return []any{subj, older, newer, ids, limit}, nil
}

// SubjectRegexp turns a NATS subject pattern into an anchored POSIX regular expression:
// * matches one token, > one or more trailing tokens, other tokens match literally.
func SubjectRegexp(pattern string) (string, error) {
	toks := strings.Split(pattern, ".")
	var b strings.Builder
	b.WriteString("^")
	for i, t := range toks {
		if t == "" || strings.ContainsAny(t, " \t\r\n") {
			return "", fmt.Errorf("%w: subject %q has an empty token or whitespace", ErrInvalidFilter, pattern)
		}
		if i > 0 {
			b.WriteString(`\.`)
		}
		switch {
		case t == "*":
			b.WriteString(`[^.]+`)
		case t == ">":
			if i != len(toks)-1 {
				return "", fmt.Errorf("%w: subject %q: '>' must be the last token", ErrInvalidFilter, pattern)
			}
			b.WriteString(`.+`)
		default:
			b.WriteString(regexp.QuoteMeta(t))
		}
	}
	b.WriteString("$")
	return b.String(), nil
}

// DeadRow is a dead message, for operators.
type DeadRow struct {
	ID           int64     `json:"id"`
	MessageID    uuid.UUID `json:"message_id"`
	Subject      string    `json:"subject"`
	Key          string    `json:"key,omitempty"`
	Attempts     int32     `json:"attempts"`
	LastError    string    `json:"last_error"`
	CreatedAt    time.Time `json:"created_at"`
	PayloadBytes int       `json:"payload_bytes"`
	Headers      HeaderMap `json:"headers,omitempty"`
}

// ListDead returns the dead rows f selects, in id order.
func (q *Queries) ListDead(ctx context.Context, db DBTX, f DeadFilter) ([]DeadRow, error) {
	args, err := f.args()
	if err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, q.ops.deadList, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []DeadRow
	for rows.Next() {
		var d DeadRow
		var key *string
		if err := rows.Scan(&d.ID, &d.MessageID, &d.Subject, &key, &d.Attempts, &d.LastError, &d.CreatedAt, &d.PayloadBytes, &d.Headers); err != nil {
			return nil, err
		}
		if key != nil {
			d.Key = *key
		}
		out = append(out, d)
	}
	return out, rows.Err()
}

// RequeueDead makes the dead rows f selects ready again (attempts 0, no error, due now) and
// returns their message ids.
func (q *Queries) RequeueDead(ctx context.Context, db DBTX, f DeadFilter) ([]uuid.UUID, error) {
	return q.deadChange(ctx, db, q.ops.deadRequeue, f)
}

// PurgeDead deletes the dead rows f selects and returns their message ids.
func (q *Queries) PurgeDead(ctx context.Context, db DBTX, f DeadFilter) ([]uuid.UUID, error) {
	return q.deadChange(ctx, db, q.ops.deadPurge, f)
}

func (q *Queries) deadChange(ctx context.Context, db DBTX, sql string, f DeadFilter) ([]uuid.UUID, error) {
	args, err := f.args()
	if err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
}

// BlockedKey is a key whose ready rows wait behind a dead row of the same key.
type BlockedKey struct {
	Key string `json:"key"`
	// Ready counts the key's ready rows after the dead row: the relay holds them back.
	Ready int64 `json:"ready"`
	// The key's first dead row.
	DeadMessageID uuid.UUID `json:"dead_message_id"`
	DeadSubject   string    `json:"dead_subject"`
	DeadAttempts  int32     `json:"dead_attempts"`
	DeadLastError string    `json:"dead_last_error"`
	DeadCreatedAt time.Time `json:"dead_created_at"`
}

// BlockedKeys returns up to limit keys held back by a dead row, those with the most ready
// rows waiting first.
func (q *Queries) BlockedKeys(ctx context.Context, db DBTX, limit int) ([]BlockedKey, error) {
	rows, err := db.Query(ctx, q.ops.blocked, int64(limit))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []BlockedKey
	for rows.Next() {
		var b BlockedKey
		if err := rows.Scan(&b.Key, &b.DeadMessageID, &b.DeadSubject, &b.DeadAttempts, &b.DeadLastError, &b.DeadCreatedAt, &b.Ready); err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, rows.Err()
}
