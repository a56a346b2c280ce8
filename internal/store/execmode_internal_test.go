package store

import (
	"context"
	"errors"
	"reflect"
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

// Every statement of Queries, not only the producer's, encodes its arguments without their
// types: the relay, the check-back and the admin commands take a pool the user configures,
// which may be in QueryExecModeExec or QueryExecModeSimpleProtocol too (ReleaseChecks, Resume
// and the dead-row filters by id passed a []uuid.UUID, which pgx cannot encode so). Each
// method taking (context.Context, DBTX, ...) is called with arguments made up from their
// types (every slice with an element, every field set), its statements captured, and each
// argument encoded as pgx does without an OID.
func TestEveryStatementArgEncodesWithoutTypes(t *testing.T) {
	ctx := context.Background()
	q := New("public")
	m := pgtype.NewMap()
	ctxType := reflect.TypeOf((*context.Context)(nil)).Elem()
	dbType := reflect.TypeOf((*DBTX)(nil)).Elem()
	qv := reflect.ValueOf(q)
	called := 0
	for i := 0; i < qv.NumMethod(); i++ {
		method := qv.Type().Method(i)
		mt := qv.Method(i).Type()
		if mt.NumIn() < 2 || mt.In(0) != ctxType || mt.In(1) != dbType {
			continue
		}
		db := &captureDB{}
		args := []reflect.Value{reflect.ValueOf(ctx), reflect.ValueOf(db)}
		for j := 2; j < mt.NumIn(); j++ {
			args = append(args, madeUp(mt.In(j), 0))
		}
		for j, v := range madeUpFor[method.Name] {
			args[2+j] = reflect.ValueOf(v)
		}
		func() {
			defer func() { _ = recover() }() // a method that needs a real answer stops after its first statement
			qv.Method(i).Call(args)
		}()
		if len(db.stmts) == 0 {
			// Every method runs a statement with these arguments: one that stops before its
			// first (a check of its arguments, a panic) would no longer be tested.
			t.Errorf("%s ran no statement with made-up arguments: give it arguments it takes (see madeUpFor)", method.Name)
			continue
		}
		called++
		for k, s := range db.stmts {
			for j, arg := range s.args {
				if _, err := m.Encode(0, pgtype.TextFormatCode, arg, nil); err != nil {
					first, _, _ := strings.Cut(strings.TrimSpace(s.sql), "\n")
					t.Errorf("%s, statement %d (%s), argument $%d (%T) does not encode without its type: %v", method.Name, k, first, j+1, arg, err)
				}
			}
		}
	}
	if called < 40 {
		t.Fatalf("only %d methods ran a statement: the discovery is broken", called)
	}
}

// madeUpFor are the arguments (after ctx and db) of the methods that check them before their
// first statement, where madeUp's would be refused.
var madeUpFor = map[string][]any{
	"PurgeMessages": {StatePublished, time.Hour, 10},
}

// madeUp returns a value of type t with everything set: slices of one element, strings "x",
// numbers 1, true, pointers to such values, structs with every exported field so set.
func madeUp(t reflect.Type, depth int) reflect.Value {
	v := reflect.New(t).Elem()
	if depth > 4 {
		return v
	}
	switch {
	case t == reflect.TypeOf(time.Time{}):
		return reflect.ValueOf(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	case t == reflect.TypeOf(uuid.UUID{}):
		return reflect.ValueOf(uuid.Must(uuid.NewV7()))
	}
	switch t.Kind() {
	case reflect.String:
		v.SetString("x")
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(1)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(1)
	case reflect.Float32, reflect.Float64:
		v.SetFloat(1)
	case reflect.Slice:
		s := reflect.MakeSlice(t, 1, 1)
		s.Index(0).Set(madeUp(t.Elem(), depth+1))
		return s
	case reflect.Ptr:
		p := reflect.New(t.Elem())
		p.Elem().Set(madeUp(t.Elem(), depth+1))
		return p
	case reflect.Struct:
		for i := 0; i < t.NumField(); i++ {
			if t.Field(i).IsExported() {
				v.Field(i).Set(madeUp(t.Field(i).Type, depth+1))
			}
		}
	}
	return v
}
