package relay

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/outbox"
)

// A promotion that moved rows commits synchronously, though the relay's session has
// synchronous_commit off: a promoted row published and then lost with an asynchronous commit
// in a crash would be scheduled again, and a cancel would then succeed for a message already
// in the stream. A claim that promoted nothing keeps the session's setting (no WAL flush to
// wait for). Both the promotion and the follow-up promotions of busy keys do it.
func TestPromotionCommitsSynchronously(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	r := e.relay(nil)
	conn, err := e.db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if err := store.SetupRelaySession(ctx, conn, "promote-sync-test"); err != nil {
		t.Fatal(err)
	}
	setting := func(tx pgx.Tx) string {
		var s string
		if err := tx.QueryRow(ctx, `SELECT current_setting('synchronous_commit')`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	inTx := func(what string, f func(tx pgx.Tx) error) string {
		t.Helper()
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if err := f(tx); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		s := setting(tx)
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return s
	}
	promote := func(tx pgx.Tx) error { _, err := r.q.Promote(ctx, tx, store.PromoteLimit); return err }

	far := e.enqueue(outbox.Message{Subject: "orders.later", Payload: []byte("x"), DeliverAt: time.Now().Add(time.Hour)})
	if got := inTx("a promotion with nothing due", promote); got != "off" {
		t.Fatalf("nothing promoted: synchronous_commit %s, want the session's off", got)
	}
	e.backdate(far...)
	if got := inTx("a promotion of a due row", promote); got != "on" {
		t.Fatalf("a row promoted: synchronous_commit %s, want on", got)
	}
	if n := e.count("state = 'scheduled'"); n != 0 {
		t.Fatalf("%d scheduled rows left, want the due one promoted", n)
	}

	// The follow-up promotion of a busy key's next due row, alone in its transaction: the
	// first statement looks at no row (limit 0), the follow-up promotes the key's due row.
	ids := e.enqueue(outbox.Message{Subject: "orders.k", Key: "busy", Payload: []byte("1"), DeliverAt: time.Now().Add(time.Hour)})
	e.backdate(ids...)
	got := inTx("a follow-up promotion", func(tx pgx.Tx) error {
		p, _, err := r.q.PromoteAndClaim(ctx, tx, 0, store.Follow{Keys: []string{"busy"}, Rounds: 1},
			store.ClaimArgs{Limit: 1, PartitionCount: 8, Exclude: []int64{}, ExcludeKeys: []string{}})
		if err == nil && p.Moved != 1 {
			t.Errorf("the follow-up moved %d rows, want 1", p.Moved)
		}
		return err
	})
	if got != "on" {
		t.Fatalf("a row promoted by the follow-up: synchronous_commit %s, want on", got)
	}
}
