package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

func TestMain(m *testing.M) { os.Exit(testsvc.ExampleMain(m)) }

// The examples read TXOUTBOX_SCHEMA as a service does; unset, they must work in the default
// schema too.
func TestExamplesInDefaultSchema(t *testing.T) { testsvc.RunExamplesInDefaultSchema(t) }

func newClient(t *testing.T, db *testsvc.DB, cfg *outbox.Config) *outbox.Client {
	t.Helper()
	if cfg == nil {
		cfg = &outbox.Config{}
	}
	cfg.Schema = db.Schema
	c, err := outbox.NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func count(t *testing.T, db *testsvc.DB, where string) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM txoutbox_messages WHERE "+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestEnqueueTxCommitAndRollback(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)

	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := c.EnqueueTx(ctx, tx,
		outbox.Message{Subject: "orders.created", Key: "order-1", Payload: []byte(`{"id":1}`), Headers: map[string][]string{"traceparent": {"00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"}}},
		outbox.Message{Subject: "orders.created", Payload: []byte(`{"id":2}`), BizKey: "order:2:created"},
	)
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != 2 || ids[0] == uuid.Nil || ids[0] == ids[1] || ids[0].Version() != 7 {
		t.Fatalf("ids = %v, want two distinct UUIDv7", ids)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	tx, err = db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.cancelled", Payload: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	if n := count(t, db, "true"); n != 2 {
		t.Fatalf("rows = %d, want 2 (the rolled back one must not exist)", n)
	}
	var key *string
	var headers map[string][]string
	var state string
	if err := db.Pool.QueryRow(ctx, "SELECT msg_key, headers, state FROM txoutbox_messages WHERE message_id = $1", ids[0]).Scan(&key, &headers, &state); err != nil {
		t.Fatal(err)
	}
	if key == nil || *key != "order-1" || headers["traceparent"][0] != "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01" || state != "ready" {
		t.Fatalf("row = key %v headers %v state %s", key, headers, state)
	}
	if err := db.Pool.QueryRow(ctx, "SELECT headers FROM txoutbox_messages WHERE message_id = $1", ids[1]).Scan(&headers); err != nil {
		t.Fatal(err)
	}
	if headers[outbox.HeaderBizKey][0] != "order:2:created" {
		t.Fatalf("biz key header = %v", headers)
	}
}

func TestEnqueueTxCallerID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	id := uuid.New()
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		got, err := c.EnqueueTx(ctx, tx, outbox.Message{ID: id, Subject: "a.b"})
		if err == nil && got[0] != id {
			return fmt.Errorf("id = %s, want %s", got[0], id)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// The same id again (second in the call) is refused with ErrDuplicateID naming the
	// message, and the caller's tx aborts.
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := c.EnqueueTx(ctx, tx, outbox.Message{Subject: "a.c"}, outbox.Message{ID: id, Subject: "a.b"})
		return err
	})
	var me *outbox.MessageError
	if !errors.Is(err, outbox.ErrDuplicateID) || !errors.As(err, &me) || me.Index != 1 || me.ID != id || me.Subject != "a.b" {
		t.Fatalf("err = %v, want a *MessageError for message 1 wrapping ErrDuplicateID", err)
	}
	if n := count(t, db, "true"); n != 1 {
		t.Fatalf("rows = %d, want 1", n)
	}
}

func TestEnqueueTxValidation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, &outbox.Config{MaxMessageBytes: 4096})
	good := outbox.Message{Subject: "orders.created", Payload: []byte("ok")}
	dupID := uuid.New()
	cases := []struct {
		name    string
		msg     outbox.Message
		extra   []outbox.Message
		want    error
		inError string
	}{
		{"empty subject", outbox.Message{Subject: ""}, nil, outbox.ErrInvalidSubject, "empty"},
		{"empty token", outbox.Message{Subject: "orders..created"}, nil, outbox.ErrInvalidSubject, "token 2 is empty"},
		{"leading dot", outbox.Message{Subject: ".orders"}, nil, outbox.ErrInvalidSubject, "token 1 is empty"},
		{"trailing dot", outbox.Message{Subject: "orders."}, nil, outbox.ErrInvalidSubject, "token 2 is empty"},
		{"wildcard star", outbox.Message{Subject: "orders.*"}, nil, outbox.ErrInvalidSubject, "wildcard"},
		{"wildcard gt", outbox.Message{Subject: "orders.>"}, nil, outbox.ErrInvalidSubject, "wildcard"},
		{"space", outbox.Message{Subject: "orders created"}, nil, outbox.ErrInvalidSubject, "whitespace"},
		{"tab", outbox.Message{Subject: "orders\tcreated"}, nil, outbox.ErrInvalidSubject, "whitespace"},
		{"too long subject", outbox.Message{Subject: strings.Repeat("a", 1025)}, nil, outbox.ErrInvalidSubject, "limit"},
		{"invalid utf8 subject", outbox.Message{Subject: "a.\xff"}, nil, outbox.ErrInvalidSubject, "UTF-8"},
		{"C1 NEL in subject", outbox.Message{Subject: "orders.a\u0085b"}, nil, outbox.ErrInvalidSubject, "control character U+0085"},
		{"C1 CSI in subject", outbox.Message{Subject: "orders.\u009b"}, nil, outbox.ErrInvalidSubject, "control character U+009B"},
		{"DEL in subject", outbox.Message{Subject: "orders.a\x7fb"}, nil, outbox.ErrInvalidSubject, "control character"},
		{"payload too large", outbox.Message{Subject: "a", Payload: make([]byte, 4096)}, nil, outbox.ErrMessageTooLarge, "limit of 4096"},
		{"headers push over", outbox.Message{Subject: "a", Payload: make([]byte, 3900), Headers: map[string][]string{"X-Big": {strings.Repeat("h", 200)}}}, nil, outbox.ErrMessageTooLarge, "headers"},
		{"header name with colon", outbox.Message{Subject: "a", Headers: map[string][]string{"Bad:Name": {"v"}}}, nil, outbox.ErrInvalidHeader, "Bad:Name"},
		{"header name with space", outbox.Message{Subject: "a", Headers: map[string][]string{"Bad Name": {"v"}}}, nil, outbox.ErrInvalidHeader, "Bad Name"},
		{"empty header name", outbox.Message{Subject: "a", Headers: map[string][]string{"": {"v"}}}, nil, outbox.ErrInvalidHeader, "not a valid header name"},
		{"header value CRLF", outbox.Message{Subject: "a", Headers: map[string][]string{"X": {"a\r\nb"}}}, nil, outbox.ErrInvalidHeader, "control character U+000D"},
		{"reserved msg id", outbox.Message{Subject: "a", Headers: map[string][]string{"Nats-Msg-Id": {"x"}}}, nil, outbox.ErrInvalidHeader, "Message.ID"},
		{"reserved key", outbox.Message{Subject: "a", Headers: map[string][]string{"txoutbox-key": {"x"}}}, nil, outbox.ErrInvalidHeader, "Message.Key"},
		{"key with newline", outbox.Message{Subject: "a", Key: "k\n1"}, nil, outbox.ErrInvalidKey, "key"},
		{"key too long", outbox.Message{Subject: "a", Key: strings.Repeat("k", 1025)}, nil, outbox.ErrInvalidKey, "limit"},
		{"duplicate id in call", outbox.Message{ID: dupID, Subject: "a"}, []outbox.Message{{ID: dupID, Subject: "b"}}, outbox.ErrDuplicateID, "same id"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			// A good message first: all or nothing means it must not be written either.
			msgs := append([]outbox.Message{good, tc.msg}, tc.extra...)
			_, err = c.EnqueueTx(ctx, tx, msgs...)
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			var me *outbox.MessageError
			if !errors.As(err, &me) {
				t.Fatalf("err %T is not a *MessageError", err)
			}
			wantIndex := 1
			if tc.extra != nil {
				wantIndex = 2
			}
			if me.Index != wantIndex || !strings.Contains(err.Error(), tc.inError) || !strings.Contains(err.Error(), fmt.Sprintf("message %d", wantIndex)) {
				t.Fatalf("error %q: index %d (want %d), want it to mention %q", err, me.Index, wantIndex, tc.inError)
			}
			// Nothing was written, and the transaction is still usable.
			var n int
			if err := tx.QueryRow(ctx, "SELECT count(*) FROM txoutbox_messages").Scan(&n); err != nil {
				t.Fatalf("tx unusable after a validation error: %v", err)
			}
			if n != 0 {
				t.Fatalf("rows = %d, want 0", n)
			}
		})
	}
}

func TestEnqueueTxSizeLimitExact(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, &outbox.Config{MaxMessageBytes: 2048})
	m := outbox.Message{Subject: "a", Key: "k", Headers: map[string][]string{"X": {"y"}}}
	m.Payload = make([]byte, 2048-outbox.EncodedSize(&m))
	if got := outbox.EncodedSize(&m); got != 2048 {
		t.Fatalf("EncodedSize = %d, want 2048", got)
	}
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { _, err := c.EnqueueTx(ctx, tx, m); return err })
	if err != nil {
		t.Fatalf("a message of exactly the limit must be accepted: %v", err)
	}
	m.Payload = append(m.Payload, 0)
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { _, err := c.EnqueueTx(ctx, tx, m); return err })
	if !errors.Is(err, outbox.ErrMessageTooLarge) {
		t.Fatalf("one byte over: err = %v, want ErrMessageTooLarge", err)
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	for field, cfg := range map[string]*outbox.Config{
		"Config.MaxMessageBytes": {MaxMessageBytes: 10},
		"Config.Schema":          {Schema: strings.Repeat("s", 64)},
	} {
		_, err := outbox.NewClient(cfg)
		var ce *txoutbox.ConfigError
		if !errors.As(err, &ce) || ce.Package != "outbox" || ce.Field != field || !errors.Is(err, txoutbox.ErrInvalidConfig) {
			t.Errorf("NewClient: err = %v, want a *txoutbox.ConfigError naming %s", err, field)
		}
		if verr := outbox.ValidateConfig(cfg); !errors.As(verr, &ce) || ce.Field != field {
			t.Errorf("ValidateConfig: err = %v, want a *txoutbox.ConfigError naming %s", verr, field)
		}
	}
}

// For one key, id order must be commit order, even when transactions race.
func TestKeyOrderIsCommitOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE commits (key text, seq bigserial, message_id uuid)"); err != nil {
		t.Fatal(err)
	}
	const workers, perWorker = 8, 25
	keys := []string{"k1", "k2", "k3"}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < perWorker; i++ {
				key := keys[(w+i)%len(keys)]
				err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
					ids, err := c.EnqueueTx(ctx, tx, outbox.Message{Subject: "k.v", Key: key})
					if err != nil {
						return err
					}
					time.Sleep(time.Duration(i%3) * time.Millisecond) // widen the race
					// Record commit order: this insert waits on nothing, but the row is only
					// visible after commit; the sequence value is drawn while the key lock is
					// held, so it orders commits of one key.
					_, err = tx.Exec(ctx, "INSERT INTO commits (key, message_id) VALUES ($1, $2)", key, ids[0])
					return err
				})
				if err != nil {
					errs <- err
					return
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for _, key := range keys {
		rows, err := db.Pool.Query(ctx, `SELECT m.id FROM txoutbox_messages m JOIN commits c USING (message_id) WHERE m.msg_key = $1 ORDER BY c.seq`, key)
		if err != nil {
			t.Fatal(err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		n := len(ids)
		for i := 1; i < n; i++ {
			if ids[i] < ids[i-1] {
				t.Fatalf("key %s: message id %d committed after id %d", key, ids[i], ids[i-1])
			}
		}
		if n == 0 {
			t.Fatalf("key %s: no rows", key)
		}
	}
}

func TestValidateSubjectFilter(t *testing.T) {
	t.Parallel()
	for s, ok := range map[string]bool{
		"orders.>": true, "orders.*.created": true, "*": true, ">": true, "orders.a*b": true,
		"orders.>.x": false, "orders..x": false, "": false, "orders .x": false, "orders.": false,
	} {
		err := outbox.ValidateSubjectFilter(s)
		if (err == nil) != ok || (err != nil && !errors.Is(err, outbox.ErrInvalidSubject)) {
			t.Errorf("ValidateSubjectFilter(%q) = %v, want ok=%v", s, err, ok)
		}
	}
}
