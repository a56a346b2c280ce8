// Package store holds every SQL statement txoutbox runs. Statements are built once per schema
// with quoted identifiers (never concatenated from unchecked input) and run against the narrow
// DBTX interface, so callers pass a pool, a connection or a transaction.
package store

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/safetext"
)

// Table names, unqualified. The schema comes from the Queries.
const (
	MessagesTable = "txoutbox_messages"
	DedupTable    = "txoutbox_consumer_dedup"
)

// Row states.
const (
	StatePrepared       = "prepared"
	StateReady          = "ready"
	StatePublished      = "published"
	StateRolledBack     = "rolled_back"
	StateDead           = "dead"
	StateCheckExhausted = "check_exhausted"
	// StateScheduled: a delayed message waiting for its delivery time (scheduled.go).
	StateScheduled = "scheduled"
)

// DBTX is txoutbox.DBTX: what queries run against.
//
// The producer's statements (InsertMessages, InsertPrepared, SettleHalf, HalfState and the
// cancel and reschedule statements) run on the caller's handle, in whatever query exec mode
// its pool was given. In pgx.QueryExecModeExec and QueryExecModeSimpleProtocol — what
// PgBouncer's transaction pooling needs — pgx does not learn the parameters' types from the
// server: it encodes each argument as text from its Go type alone, which it can for the types
// pgtype registers by default (string, int32, int64, float64, bool, time.Time, []byte, their
// pointers and slices, pgtype's own values) and for driver.Valuer implementations (uuid.UUID),
// and the statement gives the server the type (a cast, or the column the value is compared
// with or stored in). The producer's arguments are such types: an array of message ids is a
// pgtype.FlatArray[pgtype.UUID] (a [][16]byte encodes in binary only, so only in the modes
// that describe the statement first, and no faster). TestProducerAPIEveryExecMode (package
// outbox) runs every producer call in every mode.
type DBTX = txoutbox.DBTX

// MaxErrorText bounds every error text stored in last_error, in bytes.
const MaxErrorText = 1024

// ErrorText makes s, which may come from outside the process (a checker, JetStream, a
// handler), storable in last_error: valid UTF-8, no NUL, at most MaxErrorText bytes, cut on a
// character boundary. Every statement that stores an error text applies it.
func ErrorText(s string) string { return safetext.Text(s, MaxErrorText) }

// Queries holds the statements for one schema.
type Queries struct {
	Schema string
	// Advisory lock classes (first int of the two-int form, which never conflicts with the
	// single-bigint form applications commonly use), derived from the schema so that two
	// outboxes in one database do not block each other.
	// KeyLockClass and KeyBucketLockClass serialise the writers of one key so that id order is
	// commit order (keylock.go): exact locks on key hashes, and locks on their buckets.
	KeyLockClass       int32
	KeyBucketLockClass int32
	// PartitionLockClass is the relay's session-level lease on a partition (second int).
	PartitionLockClass int32

	Messages string // quoted, schema-qualified messages table
	Dedup    string // quoted, schema-qualified dedup table

	insertMessages string
	lockKeys       string
	claim          string
	floor          string
	settleDelete   string
	settleRetain   string

	half  halfSQL       // half messages and the check-back (half.go)
	dedup dedupSQL      // the idempotent consumer (dedup.go)
	sched scheduledSQL  // delayed messages (scheduled.go)
	ops   *opsQueries   // relay membership, sampling and admin statements (ops.go)
	sql   sqlStatements // the database/sql path's own statements (sqldb.go)
}

// New builds the statements for schema.
func New(schema string) *Queries {
	q := &Queries{
		Schema:   schema,
		Messages: pgx.Identifier{schema, MessagesTable}.Sanitize(),
		Dedup:    pgx.Identifier{schema, DedupTable}.Sanitize(),

		KeyLockClass:       KeyHash("txoutbox.key:" + schema),
		KeyBucketLockClass: KeyHash("txoutbox.keybucket:" + schema),
		PartitionLockClass: KeyHash("txoutbox.partition:" + schema),
	}
	q.dedup = newDedupSQL(q.Dedup)
	q.lockKeys = keyLockSQL(q, `$1::int4[]`, `$2::int4[]`)
	// Rows are produced in array order (WITH ORDINALITY ... ORDER BY) so that identity values,
	// and therefore publish order, follow the caller's order within one call.
	// A row with a delivery time is stored scheduled (scheduled.go); it becomes ready, with a
	// new id, when it falls due.
	q.insertMessages = `INSERT INTO ` + q.Messages + ` (message_id, subject, msg_key, partition_key, headers, payload, state, ready_at, deliver_at)
SELECT u.message_id, u.subject, u.msg_key, u.partition_key, u.headers, u.payload,
       CASE WHEN u.deliver_at IS NULL THEN 'ready' ELSE 'scheduled' END,
       CASE WHEN u.deliver_at IS NULL THEN clock_timestamp() END, u.deliver_at
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::int4[], $5::jsonb[], $6::bytea[], $7::timestamptz[]) WITH ORDINALITY
     AS u(message_id, subject, msg_key, partition_key, headers, payload, deliver_at, ord)
ORDER BY u.ord`
	// Claim due ready rows of the given partitions in id order, skipping every row whose key
	// has an earlier row that failed and is waiting for its retry, or is dead. $5 is the
	// claim floor (ClaimArgs.After): the scan starts above it, and an earlier failed row of
	// the key at or below it holds the key back even when due (a claim from 0 takes it).
	q.claim = `SELECT o.id, o.message_id, o.subject, o.msg_key, o.headers, o.payload, o.attempts, coalesce(o.ready_at, o.created_at),
       CASE WHEN o.deliver_at IS NOT NULL THEN ` + dueSQL("o") + ` END -- Claimed.DueAt
FROM ` + q.Messages + ` o
WHERE o.state = 'ready'
  AND o.id > $5::int8
  AND o.next_attempt_at <= now()
  AND ($2::int4[] IS NULL OR o.partition_key % $3::int4 = ANY($2::int4[]))
  AND o.id NOT IN (SELECT unnest($4::int8[])) -- a hashed subplan: O(1) per row, where = ANY is O(n)
  AND (o.msg_key IS NULL OR o.msg_key NOT IN (SELECT unnest($6::text[])))
  AND (o.msg_key IS NULL OR NOT EXISTS (
        SELECT 1 FROM ` + q.Messages + ` b
        WHERE b.msg_key = o.msg_key AND b.id < o.id
          AND b.attempts > 0 AND b.state IN ('ready', 'dead')
          AND (b.state = 'dead' OR b.next_attempt_at > now() OR b.id <= $5::int8)))
ORDER BY o.id
LIMIT $1`
	q.floor = floorStatement(q.Messages)
	settleFailed := `failed AS (
  UPDATE ` + q.Messages + ` o
  SET attempts = o.attempts + 1,
      last_error = f.err,
      next_attempt_at = now() + f.delay_ms * interval '1 millisecond',
      state = CASE WHEN f.permanent OR o.attempts + 1 >= $5::int4 THEN 'dead' ELSE 'ready' END
  FROM unnest($2::int8[], $3::text[], $4::float8[], $6::bool[]) AS f(id, err, delay_ms, permanent)
  WHERE o.id = f.id AND o.state = 'ready'
  RETURNING o.id, o.message_id, o.state
)`
	q.settleDelete = `WITH ok AS (
  DELETE FROM ` + q.Messages + ` WHERE id = ANY($1::int8[]) AND state = 'ready' RETURNING id
), ` + settleFailed + `
SELECT (SELECT count(*) FROM ok),
       coalesce((SELECT array_agg(message_id) FROM failed WHERE state = 'dead'), '{}')`
	q.settleRetain = `WITH okv AS (
  SELECT * FROM unnest($1::int8[], $7::text[], $8::int8[]) AS v(id, stream, seq)
), ok AS (
  UPDATE ` + q.Messages + ` o SET state = 'published', published_at = now(), stream = okv.stream, stream_seq = okv.seq
  FROM okv WHERE o.id = okv.id AND o.state = 'ready' RETURNING o.id
), ` + settleFailed + `
SELECT (SELECT count(*) FROM ok),
       coalesce((SELECT array_agg(message_id) FROM failed WHERE state = 'dead'), '{}')`
	q.half = newHalfSQL(q)
	q.sched = newScheduledSQL(q)
	q.ops = newOpsQueries(q)
	q.sql = newSQLStatements(q)
	return q
}

// KeyHash is the 31-bit hash of an ordering key (or of a message id for unkeyed messages): it
// is both the advisory lock that orders a key's enqueuers (KeyHash % KeyLockBuckets is its
// bucket) and the row's partition_key.
func KeyHash(s string) int32 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(s))
	return int32(h.Sum32() & 0x7fff_ffff)
}

// NewRow is a message to insert.
type NewRow struct {
	MessageID uuid.UUID
	Subject   string
	Key       string // "" for none
	Headers   []byte // JSON object, or nil
	Payload   []byte
	// DeliverAt, when set, stores the row scheduled for that time instead of ready.
	DeliverAt *time.Time
}

// columns returns the row's nullable columns as they are stored: the key (nil when none),
// partition_key (the key's hash, the lock EnqueueTx takes; the id's hash without a key), the
// headers (nil when none) and the payload (never NULL).
func (r NewRow) columns() (key *string, part int32, headers *string, payload []byte) {
	if r.Key != "" {
		k := r.Key
		key, part = &k, KeyHash(r.Key)
	} else {
		part = KeyHash(r.MessageID.String())
	}
	if r.Headers != nil {
		h := string(r.Headers)
		headers = &h
	}
	payload = r.Payload
	if payload == nil {
		payload = []byte{}
	}
	return key, part, headers, payload
}

// UniqueViolation reports whether err is a unique violation of the message id constraint.
func UniqueViolation(err error) bool {
	_, ok := DuplicateMessageID(err)
	return ok
}

// DuplicateMessageID reports whether err is a unique violation on the outbox's message id,
// and which id it was, when the server said (uuid.Nil otherwise).
func DuplicateMessageID(err error) (uuid.UUID, bool) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" || pgErr.ConstraintName != "txoutbox_messages_message_id_key" {
		return uuid.Nil, false
	}
	// Detail: Key (message_id)=(0192…) already exists.
	_, rest, _ := strings.Cut(pgErr.Detail, ")=(")
	v, _, _ := strings.Cut(rest, ")")
	id, _ := uuid.Parse(v)
	return id, true
}

// InsertMessages locks the keys of rows (see keylock.go: in one order, so that concurrent
// calls cannot deadlock on them) and inserts the rows, in one round trip.
func (q *Queries) InsertMessages(ctx context.Context, db DBTX, rows []NewRow) error {
	return q.insertRows(ctx, db, rows, true)
}

// InsertMessagesUnlocked is InsertMessages without the key locks: the same statement and
// argument encoding, for benchmarks' lower bound of a write (a producer must not use it: per
// key commit order needs the locks).
func (q *Queries) InsertMessagesUnlocked(ctx context.Context, db DBTX, rows []NewRow) error {
	return q.insertRows(ctx, db, rows, false)
}

// uuidArray is ids as an argument every exec mode encodes (see DBTX): a []uuid.UUID has no
// text encoding pgx finds from its Go type alone. Never nil: an empty array.
func uuidArray(ids []uuid.UUID) pgtype.FlatArray[pgtype.UUID] {
	out := make(pgtype.FlatArray[pgtype.UUID], len(ids))
	for i, id := range ids {
		out[i] = pgtype.UUID{Bytes: id, Valid: true}
	}
	return out
}

func (q *Queries) insertRows(ctx context.Context, db DBTX, rows []NewRow, lock bool) error {
	n := len(rows)
	ids := make(pgtype.FlatArray[pgtype.UUID], n) // encodes in every exec mode (see DBTX)
	subjects := make([]string, n)
	keys := make([]*string, n)
	parts := make([]int32, n)
	headers := make([]*string, n)
	payloads := make([][]byte, n)
	deliverAt := make([]*time.Time, n)
	var lockKeys []int32
	for i, r := range rows {
		ids[i] = pgtype.UUID{Bytes: r.MessageID, Valid: true}
		subjects[i] = r.Subject
		keys[i], parts[i], headers[i], payloads[i] = r.columns()
		deliverAt[i] = r.DeliverAt
		// A scheduled row draws its final id, under its key's lock, when it falls due.
		if lock && keys[i] != nil && r.DeliverAt == nil {
			lockKeys = append(lockKeys, parts[i])
		}
	}
	b := &pgx.Batch{}
	if len(lockKeys) > 0 {
		sorted, buckets := keyLockArgs(lockKeys)
		b.Queue(q.lockKeys, sorted, buckets)
	}
	b.Queue(q.insertMessages, ids, subjects, keys, parts, headers, payloads, deliverAt)
	br := db.SendBatch(ctx, b)
	if len(lockKeys) > 0 {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			return fmt.Errorf("lock keys: %w", lockTableFull(err))
		}
	}
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return lockTableFull(err)
	}
	return lockTableFull(br.Close())
}

// Claimed is a ready row taken by the relay.
type Claimed struct {
	ID        int64
	MessageID uuid.UUID
	Subject   string
	Key       string
	Headers   []byte
	Payload   []byte
	Attempts  int32
	ReadyAt   time.Time
	// DueAt is when a delayed message became due (zero for others): the latest of its
	// delivery time and the times it could not yet have been published, its insert
	// (created_at), its half message's commit or its last RescheduleTx (settled_at, see
	// scheduled.go). Its lateness is measured from here: a delivery time already past when the
	// message was committed or rescheduled is no lateness of the relay's.
	DueAt time.Time
}

// ClaimArgs selects what Claim returns.
type ClaimArgs struct {
	Limit int
	// Partitions to claim from, out of PartitionCount; nil means all.
	Partitions     []int32
	PartitionCount int32
	// Exclude lists ids left out: rows in flight, and unkeyed rows held back for a stream
	// outage.
	Exclude []int64
	// ExcludeKeys lists keys whose rows are all left out (a row of the key is held back for a
	// stream outage: its later rows must not go before it).
	ExcludeKeys []string
	// After is the claim floor: only rows with a higher id are claimed, and a key whose
	// earlier failed row is at or below it is held back. 0 claims from the start. See
	// ClaimFloor for when a floor is safe.
	After int64
}

// Claim returns up to Limit due ready rows in id order (see the statement for the key rule).
func (q *Queries) Claim(ctx context.Context, db DBTX, a ClaimArgs) ([]Claimed, error) {
	rows, err := db.Query(ctx, q.claim, a.args()...)
	if err != nil {
		return nil, err
	}
	return scanClaimed(rows, a.Limit)
}

// args are the claim statement's arguments.
func (a ClaimArgs) args() []any {
	excl := a.Exclude
	if excl == nil {
		excl = []int64{}
	}
	count := a.PartitionCount
	if count <= 0 {
		count = 1
	}
	keys := a.ExcludeKeys
	if keys == nil {
		keys = []string{}
	}
	return []any{a.Limit, a.Partitions, count, excl, a.After, keys}
}

func scanClaimed(rows pgx.Rows, limit int) ([]Claimed, error) {
	defer rows.Close()
	out := make([]Claimed, 0, limit)
	for rows.Next() {
		var c Claimed
		var key *string
		var due *time.Time
		if err := rows.Scan(&c.ID, (*[16]byte)(&c.MessageID), &c.Subject, &key, &c.Headers, &c.Payload, &c.Attempts, &c.ReadyAt, &due); err != nil {
			return nil, err
		}
		if key != nil {
			c.Key = *key
		}
		if due != nil {
			c.DueAt = *due
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// Published is a row whose PubAck arrived.
type Published struct {
	ID     int64
	Stream string
	Seq    uint64
}

// Failed is a row whose publish failed with a message-level error.
type Failed struct {
	ID  int64
	Err string
	// Delay until the next attempt, counted from the database's clock.
	Delay time.Duration
	// Permanent makes the row dead at once, whatever its attempts: retrying cannot help.
	Permanent bool
}

// SettleArgs is one batch's outcome.
type SettleArgs struct {
	Published   []Published
	Failed      []Failed
	MaxAttempts int
	// Retain keeps published rows (state published, published_at set) instead of deleting them.
	Retain bool
}

// SettleResult says what Settle changed.
type SettleResult struct {
	Published int64
	// Dead lists the message ids that reached MaxAttempts in this settle.
	Dead []uuid.UUID
}

// Settle applies a batch's outcome in one statement: published rows are deleted (or marked
// published), failed rows get attempts+1, their error and their next attempt time, and become
// dead when they reach MaxAttempts or their failure is Permanent. Only rows still ready are
// touched.
func (q *Queries) Settle(ctx context.Context, db DBTX, a SettleArgs) (SettleResult, error) {
	okIDs := make([]int64, len(a.Published))
	streams := make([]string, len(a.Published))
	seqs := make([]int64, len(a.Published))
	for i, p := range a.Published {
		okIDs[i], streams[i], seqs[i] = p.ID, p.Stream, int64(p.Seq)
	}
	fIDs := make([]int64, len(a.Failed))
	fErrs := make([]string, len(a.Failed))
	fNext := make([]float64, len(a.Failed))
	fPerm := make([]bool, len(a.Failed))
	for i, f := range a.Failed {
		fIDs[i], fErrs[i], fNext[i], fPerm[i] = f.ID, ErrorText(f.Err), float64(f.Delay)/float64(time.Millisecond), f.Permanent
	}
	var res SettleResult
	var err error
	if a.Retain {
		err = db.QueryRow(ctx, q.settleRetain, okIDs, fIDs, fErrs, fNext, int32(a.MaxAttempts), fPerm, streams, seqs).Scan(&res.Published, &res.Dead)
	} else {
		err = db.QueryRow(ctx, q.settleDelete, okIDs, fIDs, fErrs, fNext, int32(a.MaxAttempts), fPerm).Scan(&res.Published, &res.Dead)
	}
	return res, err
}
