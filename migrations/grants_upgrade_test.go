package migrations_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/migrations"
)

// A producer role granted at migration 4 (before delayed messages) keeps working after
// migrations 5 and 7 without a new grant: committing a half message (which now reads
// deliver_at), the new cancel and reschedule functions, and enqueueing (migration 7's
// txoutbox_partition_keys). Without the grants migration 5 carries over,
// the commit fails with "permission denied for table txoutbox_messages".
func TestProducerGrantedBeforeMigration5KeepsWorking(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	m, err := migrations.New(&migrations.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	for v, err := m.Version(ctx, db.Pool); v > 4; v, err = m.Version(ctx, db.Pool) {
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.Down(ctx, db.Pool, 1); err != nil {
			t.Fatalf("down from %d: %v", v, err)
		}
	}
	role := "prod_" + strings.TrimPrefix(db.Schema, "t_")
	if len(role) > 63 {
		role = role[:63]
	}
	grants, err := migrations.Grants(migrations.RoleProducer, db.Schema, role, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The producer's grants as migration 4 knew them: without the deliver_at column, which
	// does not exist yet.
	var old []string
	for _, line := range strings.Split(grants, "\n") {
		if !strings.Contains(line, "deliver_at") {
			old = append(old, line)
		}
	}
	if _, err := db.AdminPool.Exec(ctx, strings.Join(old, "\n")); err != nil {
		t.Fatalf("grants at migration 4: %v", err)
	}
	t.Cleanup(func() {
		_, _ = db.AdminPool.Exec(context.Background(), "DROP OWNED BY "+pgx.Identifier{role}.Sanitize())
		_, _ = db.AdminPool.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{role}.Sanitize())
	})
	if _, err := m.Up(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}

	asProducer := func(what, sql string) {
		t.Helper()
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SET LOCAL ROLE "+pgx.Identifier{role}.Sanitize()); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, sql)
			return err
		})
		if err != nil {
			t.Fatalf("%s as the producer granted at migration 4: %v", what, err)
		}
	}
	asProducer("enqueue", `SELECT txoutbox_enqueue('orders.x', 'p')`)
	// Migration 7's txoutbox_partition_keys, which txoutbox_write calls with the caller's rights.
	asProducer("enqueue many with keys", `SELECT txoutbox_enqueue_many(ARRAY['orders.x', 'orders.y'], ARRAY['p', 'q']::bytea[], ARRAY['k1', ''])`)
	asProducer("prepare and commit a half message", `SELECT txoutbox_commit(txoutbox_prepare('orders.x', 'p', producer_group => 'g1'))`)
	asProducer("prepare and roll back a half message", `SELECT txoutbox_rollback(txoutbox_prepare('orders.x', 'p', producer_group => 'g1'))`)
	asProducer("enqueue a delayed message and reschedule it", `SELECT txoutbox_reschedule(txoutbox_enqueue('orders.y', 'p', deliver_at => now() + interval '1 hour'), now() + interval '2 hours')`)
	asProducer("enqueue a delayed message and cancel it", `SELECT txoutbox_cancel(txoutbox_enqueue('orders.z', 'p', deliver_at => now() + interval '1 hour'))`)
	// The Go client's commit statement reads deliver_at too (internal/store/half.go).
	asProducer("read deliver_at", `SELECT deliver_at FROM txoutbox_messages LIMIT 1`)
}
