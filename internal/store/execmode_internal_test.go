package store

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

var errCaptured = errors.New("captured")

// captureDB records the arguments of every statement run on it and answers nothing.
type captureDB struct{ stmts []capturedStmt }

type capturedStmt struct {
	sql  string
	args []any
}

func (c *captureDB) add(sql string, args []any) { c.stmts = append(c.stmts, capturedStmt{sql, args}) }

func (c *captureDB) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c.add(sql, args)
	return pgconn.NewCommandTag("UPDATE 0"), nil
}

func (c *captureDB) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	c.add(sql, args)
	return nil, errCaptured
}

func (c *captureDB) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	c.add(sql, args)
	return capturedRow{}
}

func (c *captureDB) SendBatch(_ context.Context, b *pgx.Batch) pgx.BatchResults {
	for _, q := range b.QueuedQueries {
		c.add(q.SQL, q.Arguments)
	}
	return capturedBatch{}
}

type capturedRow struct{}

func (capturedRow) Scan(...any) error { return errCaptured }

type capturedBatch struct{}

func (capturedBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, errCaptured }
func (capturedBatch) Query() (pgx.Rows, error)         { return nil, errCaptured }
func (capturedBatch) QueryRow() pgx.Row                { return capturedRow{} }
func (capturedBatch) Close() error                     { return errCaptured }
func (capturedBatch) Tx() pgx.Tx                       { return nil }

// TestProducerArgsEncodeWithoutTypes: every argument of every producer statement encodes as
// pgx encodes it in QueryExecModeExec and QueryExecModeSimpleProtocol (PgBouncer's
// transaction pooling), where it does not know the parameter's type: as text, from the Go
// type alone (pgtype.Map.Encode with OID 0). A [][16]byte of message ids did not
// (outbox.EnqueueTx failed on such a pool); TestProducerAPIEveryExecMode (package outbox)
// runs the calls against PostgreSQL in every mode.
func TestProducerArgsEncodeWithoutTypes(t *testing.T) {
	ctx := context.Background()
	q := New("public")
	at := time.Date(2030, 1, 1, 0, 0, 0, 1000, time.UTC)
	id := uuid.Must(uuid.NewV7())
	rows := []NewRow{
		{MessageID: id, Subject: "orders.created", Key: "order-1", Headers: []byte(`{"X":["1"]}`), Payload: []byte{0, 1, 2}},
		{MessageID: uuid.Must(uuid.NewV7()), Subject: "orders.created"},
		{MessageID: uuid.Must(uuid.NewV7()), Subject: "orders.timeout", Key: "order-1", DeliverAt: &at},
	}
	calls := []struct {
		name string
		run  func(db DBTX)
	}{
		{"InsertMessages", func(db DBTX) { _ = q.InsertMessages(ctx, db, rows) }},
		{"InsertPrepared", func(db DBTX) {
			_ = q.InsertPrepared(ctx, db, PrepareArgs{Row: rows[2], Group: "g", Mode: CheckModeChecker, Immunity: time.Second})
		}},
		{"SettleHalf commit", func(db DBTX) {
			_, _, _ = q.SettleHalf(ctx, db, HalfSettle{MessageID: id, Commit: true, By: SettledByProducer})
		}},
		{"SettleHalf rollback", func(db DBTX) {
			_, _, _ = q.SettleHalf(ctx, db, HalfSettle{MessageID: id, By: SettledByProducer, CountCheck: true})
		}},
		{"HalfState", func(db DBTX) { _, _ = q.HalfState(ctx, db, id) }},
		{"CancelScheduled", func(db DBTX) { _, _, _ = q.CancelScheduled(ctx, db, id) }},
		{"RescheduleScheduled", func(db DBTX) { _, _, _ = q.RescheduleScheduled(ctx, db, id, at) }},
		{"CancelScheduledBizKey", func(db DBTX) { _, _ = q.CancelScheduledBizKey(ctx, db, "order:1:timeout") }},
		{"RescheduleScheduledBizKey", func(db DBTX) { _, _ = q.RescheduleScheduledBizKey(ctx, db, "order:1:timeout", at) }},
		{"ScheduledBizKeyState", func(db DBTX) { _, _ = q.ScheduledBizKeyState(ctx, db, "order:1:timeout") }},
		{"ScheduledState", func(db DBTX) { _, _ = q.ScheduledState(ctx, db, id) }},
	}
	m := pgtype.NewMap()
	for _, c := range calls {
		db := &captureDB{}
		c.run(db)
		if len(db.stmts) == 0 {
			t.Errorf("%s ran no statement", c.name)
		}
		for i, s := range db.stmts {
			for j, arg := range s.args {
				if _, err := m.Encode(0, pgtype.TextFormatCode, arg, nil); err != nil {
					first, _, _ := strings.Cut(strings.TrimSpace(s.sql), "\n")
					t.Errorf("%s, statement %d (%s), argument $%d (%T) does not encode without its type: %v", c.name, i, first, j+1, arg, err)
				}
			}
		}
	}
}
