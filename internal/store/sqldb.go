package store

// The producer's statements over database/sql (txoutbox.SQLDBTX), for any driver that speaks to
// PostgreSQL. They are the pgx statements of this package, run with arguments every driver
// can send: database/sql's default converter takes scalars only (string, []byte, int64,
// float64, bool, time.Time, nil); pgx's stdlib driver also takes slices, lib/pq needs
// pq.Array, other drivers take neither. So arrays travel as PostgreSQL array literals in one
// string each (the statements cast them, $1::uuid[] and so on), which every driver sends as
// text, and the key locks and the insert are one statement: database/sql cannot pipeline, and
// EnqueueTx's batch would otherwise cost a second round trip.

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox"
)

// SQLDBTX is txoutbox.SQLDBTX: what the database/sql statements run against.
type SQLDBTX = txoutbox.SQLDBTX

// sqlStatements are the statements only the database/sql path runs.
type sqlStatements struct {
	// insertLocked is insertMessages preceded, in the same statement, by the key locks
	// (keyLockSQL on the two parameters after the insert's): the locks are taken in a
	// materialized CTE that the insert's rows are gated on, before the sort on the caller's
	// order and so before any row draws its id.
	insertLocked string
}

var paramRE = regexp.MustCompile(`\$([0-9]+)`)

func newSQLStatements(q *Queries) sqlStatements {
	n := 0
	for _, m := range paramRE.FindAllStringSubmatch(q.insertMessages, -1) {
		if v, _ := strconv.Atoi(m[1]); v > n {
			n = v
		}
	}
	const anchor = "\nORDER BY u.ord"
	if strings.Count(q.insertMessages, anchor) != 1 || strings.HasPrefix(q.insertMessages, "WITH") {
		panic("store: insertMessages changed shape: update newSQLStatements")
	}
	lock := keyLockSQL(q, "$"+strconv.Itoa(n+1)+"::int4[]", "$"+strconv.Itoa(n+2)+"::int4[]")
	return sqlStatements{
		insertLocked: "WITH l AS MATERIALIZED (\n" + lock + "\n)\n" +
			strings.Replace(q.insertMessages, anchor, "\nWHERE (SELECT count(*) FROM l) >= 0"+anchor, 1),
	}
}

// InsertMessagesSQL is InsertMessages over database/sql: it locks the keys of rows and
// inserts the rows in one statement, in the caller's order.
func (q *Queries) InsertMessagesSQL(ctx context.Context, db SQLDBTX, rows []NewRow) error {
	n := len(rows)
	keys := make([]*string, n)
	parts := make([]int32, n)
	headers := make([]*string, n)
	payloads := make([][]byte, n)
	var lockKeys []int32
	for i, r := range rows {
		keys[i], parts[i], headers[i], payloads[i] = r.columns()
		// A scheduled row draws its final id, under its key's lock, when it falls due.
		if keys[i] != nil && r.DeliverAt == nil {
			lockKeys = append(lockKeys, parts[i])
		}
	}
	args := []any{
		arrayLiteral(n, func(b *strings.Builder, i int) bool { b.WriteString(rows[i].MessageID.String()); return true }),
		arrayLiteral(n, func(b *strings.Builder, i int) bool { quoteElem(b, rows[i].Subject); return true }),
		arrayLiteral(n, func(b *strings.Builder, i int) bool { return quoteOpt(b, keys[i]) }),
		int4Literal(parts),
		arrayLiteral(n, func(b *strings.Builder, i int) bool { return quoteOpt(b, headers[i]) }),
		byteaLiteral(payloads),
		arrayLiteral(n, func(b *strings.Builder, i int) bool {
			if rows[i].DeliverAt == nil {
				return false
			}
			b.WriteString(timestampLiteral(*rows[i].DeliverAt))
			return true
		}),
	}
	stmt := q.insertMessages
	if len(lockKeys) > 0 {
		sorted, buckets := keyLockArgs(lockKeys)
		args = append(args, int4Literal(sorted), int4Literal(buckets))
		stmt = q.sql.insertLocked
	}
	_, err := db.ExecContext(ctx, stmt, args...)
	return lockTableFullSQL(err)
}

// InsertPreparedSQL is InsertPrepared over database/sql.
func (q *Queries) InsertPreparedSQL(ctx context.Context, db SQLDBTX, a PrepareArgs) error {
	r := a.Row
	key, part, hdr, payload := r.columns()
	var group *string
	if a.Group != "" {
		g := a.Group
		group = &g
	}
	var due *string
	if r.DeliverAt != nil {
		s := timestampLiteral(*r.DeliverAt)
		due = &s
	}
	_, err := db.ExecContext(ctx, q.half.insertPrepared, r.MessageID.String(), r.Subject, key, int64(part), hdr, payload, group, a.Mode, ms(max(a.Immunity, 0)), due)
	return err
}

// CancelScheduledSQL is CancelScheduled over database/sql: the same statements (the update,
// then, when it changed nothing, the state in a second statement).
func (q *Queries) CancelScheduledSQL(ctx context.Context, db SQLDBTX, id uuid.UUID) (bool, string, error) {
	return q.changeScheduledSQL(ctx, db, id, q.sched.cancel, id.String())
}

// RescheduleScheduledSQL is RescheduleScheduled over database/sql.
func (q *Queries) RescheduleScheduledSQL(ctx context.Context, db SQLDBTX, id uuid.UUID, at time.Time) (bool, string, error) {
	return q.changeScheduledSQL(ctx, db, id, q.sched.reschedule, id.String(), timestampLiteral(at))
}

func (q *Queries) changeScheduledSQL(ctx context.Context, db SQLDBTX, id uuid.UUID, stmt string, args ...any) (bool, string, error) {
	res, err := db.ExecContext(ctx, stmt, args...)
	if err != nil {
		return false, "", err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, "", err
	}
	if n == 1 {
		return true, "", nil
	}
	var st string
	err = db.QueryRowContext(ctx, q.sched.state, id.String()).Scan(&st)
	if errors.Is(err, sql.ErrNoRows) {
		return false, "", ErrNoRow
	}
	return false, st, err
}

// ScheduledBizKeyStateSQL is ScheduledBizKeyState over database/sql.
func (q *Queries) ScheduledBizKeyStateSQL(ctx context.Context, db SQLDBTX, bizKey string) (string, error) {
	var st string
	err := db.QueryRowContext(ctx, q.sched.bizKeyState, bizKey).Scan(&st)
	if errors.Is(err, sql.ErrNoRows) {
		return "", ErrNoRow
	}
	return st, err
}

// CancelScheduledBizKeySQL is CancelScheduledBizKey over database/sql.
func (q *Queries) CancelScheduledBizKeySQL(ctx context.Context, db SQLDBTX, bizKey string) ([]uuid.UUID, error) {
	return collectIDsSQL(ctx, db, q.sched.cancelBiz, bizKey)
}

// RescheduleScheduledBizKeySQL is RescheduleScheduledBizKey over database/sql.
func (q *Queries) RescheduleScheduledBizKeySQL(ctx context.Context, db SQLDBTX, bizKey string, at time.Time) ([]uuid.UUID, error) {
	return collectIDsSQL(ctx, db, q.sched.rescheduleBiz, bizKey, timestampLiteral(at))
}

// collectIDsSQL runs stmt and returns the message ids of its rows (a uuid column, which
// drivers return as text).
func collectIDsSQL(ctx context.Context, db SQLDBTX, stmt string, args ...any) (ids []uuid.UUID, err error) {
	rows, err := db.QueryContext(ctx, stmt, args...)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, rows.Close()) }()
	for rows.Next() {
		var id uuid.UUID
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
}

// timestampLiteral is t as PostgreSQL reads a timestamptz, to the microsecond, truncated as
// pgx sends it (package outbox rounds delivery times up to the microsecond before they get
// here, so that nothing is cut).
func timestampLiteral(t time.Time) string {
	return t.UTC().Truncate(time.Microsecond).Format("2006-01-02T15:04:05.999999Z")
}

// SettleHalfSQL is SettleHalf over database/sql. Committing takes two statements (the key's
// lock, then the update that draws the new id): database/sql cannot pipeline them.
func (q *Queries) SettleHalfSQL(ctx context.Context, tx SQLDBTX, a HalfSettle) (settled bool, state string, err error) {
	from := a.From
	if from == nil {
		from = SettleableStates
	}
	fromLit := arrayLiteral(len(from), func(b *strings.Builder, i int) bool { quoteElem(b, from[i]); return true })
	inc := int64(0)
	if a.CountCheck {
		inc = 1
	}
	id := a.MessageID.String()
	stmt := q.half.rollback
	if a.Commit {
		stmt = q.half.commit
		if _, err := tx.ExecContext(ctx, q.half.lockKey, id, fromLit); err != nil {
			return false, "", fmt.Errorf("lock key: %w", lockTableFullSQL(err))
		}
	}
	res, err := tx.ExecContext(ctx, stmt, id, a.By, fromLit, inc)
	if err != nil {
		return false, "", lockTableFullSQL(err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, "", err
	}
	if n == 1 {
		if a.Commit {
			return true, StateReady, nil
		}
		return true, StateRolledBack, nil
	}
	var st string
	err = tx.QueryRowContext(ctx, q.half.state, id).Scan(&st)
	if errors.Is(err, sql.ErrNoRows) {
		return false, "", ErrNoRow
	}
	return false, st, err
}

// InsertDedupSQL is InsertDedup over database/sql: it records r in db (the consumer's
// transaction) and reports false when the key is already recorded.
func (q *Queries) InsertDedupSQL(ctx context.Context, db SQLDBTX, r DedupRow) (bool, error) {
	res, err := db.ExecContext(ctx, q.dedup.insert, r.args()...)
	if err != nil {
		return false, err
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

// NotifySQL sends an empty pg_notify on channel through db.
func NotifySQL(ctx context.Context, db SQLDBTX, channel string) error {
	_, err := db.ExecContext(ctx, "SELECT pg_notify($1, '')", channel)
	return err
}

// SQLState returns the SQLSTATE of err, or "" when no error in its chain carries one. Both
// pgx's *pgconn.PgError and lib/pq's *pq.Error have a SQLState method.
func SQLState(err error) string {
	var e interface{ SQLState() string }
	if errors.As(err, &e) {
		return e.SQLState()
	}
	return ""
}

// serverErrorField returns the string field name of the server error in err's chain (the
// error with a SQLState method), or "" when it has none: pgx's PgError and lib/pq's Error
// name the server's fields alike (Detail; ConstraintName and Constraint).
func serverErrorField(err error, names ...string) string {
	var e interface{ SQLState() string }
	if !errors.As(err, &e) {
		return ""
	}
	v := reflect.ValueOf(e)
	for v.Kind() == reflect.Pointer {
		v = v.Elem()
	}
	if v.Kind() != reflect.Struct {
		return ""
	}
	for _, name := range names {
		if f := v.FieldByName(name); f.IsValid() && f.Kind() == reflect.String {
			return f.String()
		}
	}
	return ""
}

// DuplicateMessageIDSQL is DuplicateMessageID for any driver whose errors carry the SQLSTATE
// (a SQLState method): a unique violation of the outbox's message id, and the id when the
// server's detail is at hand (uuid.Nil otherwise).
func DuplicateMessageIDSQL(err error) (uuid.UUID, bool) {
	if id, ok := DuplicateMessageID(err); ok {
		return id, true
	}
	if SQLState(err) != "23505" {
		return uuid.Nil, false
	}
	if c := serverErrorField(err, "ConstraintName", "Constraint"); c != "" && c != "txoutbox_messages_message_id_key" {
		return uuid.Nil, false
	}
	_, rest, _ := strings.Cut(serverErrorField(err, "Detail"), ")=(")
	v, _, _ := strings.Cut(rest, ")")
	id, _ := uuid.Parse(v)
	return id, true
}

// lockTableFullSQL is lockTableFull for any driver whose errors carry the SQLSTATE.
func lockTableFullSQL(err error) error {
	if err != nil && SQLState(err) == "53200" && !errors.Is(err, ErrLockTableFull) {
		return fmt.Errorf("%w: %s: %w", ErrLockTableFull, lockTableHint, err)
	}
	return err
}

// arrayLiteral writes a PostgreSQL array literal of n elements; elem writes element i and
// reports false for NULL (having written nothing).
func arrayLiteral(n int, elem func(b *strings.Builder, i int) bool) string {
	var b strings.Builder
	b.WriteByte('{')
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		if !elem(&b, i) {
			b.WriteString("NULL")
		}
	}
	b.WriteByte('}')
	return b.String()
}

// quoteElem writes s as a double-quoted array element: backslashes and double quotes escaped,
// everything else (commas, braces, white space, the word NULL) kept as it is.
func quoteElem(b *strings.Builder, s string) {
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == '"' || c == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	b.WriteByte('"')
}

// quoteOpt writes *s quoted, or nothing (NULL) when s is nil.
func quoteOpt(b *strings.Builder, s *string) bool {
	if s == nil {
		return false
	}
	quoteElem(b, *s)
	return true
}

func int4Literal(v []int32) string {
	return arrayLiteral(len(v), func(b *strings.Builder, i int) bool {
		b.WriteString(strconv.FormatInt(int64(v[i]), 10))
		return true
	})
}

// byteaLiteral writes payloads as a bytea[] literal of hex values ("\\x0a0b": the array
// element's backslash escaped).
func byteaLiteral(payloads [][]byte) string {
	size := 2
	for _, p := range payloads {
		size += 2*len(p) + 6
	}
	var b strings.Builder
	b.Grow(size)
	buf := make([]byte, 0, 1024)
	b.WriteByte('{')
	for i, p := range payloads {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(`"\\x`)
		buf = hex.AppendEncode(buf[:0], p)
		b.Write(buf)
		b.WriteByte('"')
	}
	b.WriteByte('}')
	return b.String()
}

// OutboxIdentityQuery returns the cluster's system identifier, the current database and
// whether schema $1 holds the outbox table: the outbox identity of package checker. The
// catalogs answer any role, whatever its privileges on the schema.
const OutboxIdentityQuery = `SELECT system_identifier, current_database(),
       EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
               WHERE n.nspname = $1 AND c.relname = '` + MessagesTable + `')
FROM pg_control_system()`

// Alive runs an empty statement on db: it fails when db's connection is gone.
func Alive(ctx context.Context, db SQLDBTX) error {
	_, err := db.ExecContext(ctx, "SELECT 1")
	return err
}
