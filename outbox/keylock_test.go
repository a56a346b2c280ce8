package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
)

// keyed returns n messages with the keys prefix0 … prefix<n-1>.
func keyed(prefix string, n int) []outbox.Message {
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = outbox.Message{Subject: "k.v", Key: fmt.Sprintf("%s%d", prefix, i)}
	}
	return msgs
}

// advisoryLocks counts the advisory locks tx's backend holds.
func advisoryLocks(t *testing.T, tx pgx.Tx) int {
	t.Helper()
	var n int
	if err := tx.QueryRow(context.Background(), `SELECT count(*) FROM pg_locks
		WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// maxKeyLocks is the most advisory locks (pg_locks rows) a transaction may hold for its keys.
const maxKeyLocks = store.KeyLockBuckets + 2*store.KeyLockBudget

// One call may enqueue any number of distinct keys: past the budget it locks buckets, and the
// transaction never holds more than maxKeyLocks advisory locks.
func TestEnqueueTxManyKeysInOneCall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	// A call that uses up the budget exactly (exact mode), then 20,000 keys in one call.
	if _, err := c.EnqueueTx(ctx, tx, keyed("small-", store.KeyLockBudget)...); err != nil {
		t.Fatal(err)
	}
	if n := advisoryLocks(t, tx); n <= store.KeyLockBudget {
		t.Fatalf("%d advisory locks after %d keys in exact mode, want the keys and their buckets", n, store.KeyLockBudget)
	}
	if _, err := c.EnqueueTx(ctx, tx, keyed("big-", 20_000)...); err != nil {
		t.Fatal(err)
	}
	if n := advisoryLocks(t, tx); n > maxKeyLocks {
		t.Fatalf("the transaction holds %d advisory locks, want at most %d", n, maxKeyLocks)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, db, "msg_key IS NOT NULL"); n != store.KeyLockBudget+20_000 {
		t.Fatalf("rows = %d, want %d", n, store.KeyLockBudget+20_000)
	}
}

// The budget counts across the calls of one transaction.
func TestEnqueueTxManyKeysInManyCalls(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for i := range 100 {
		if _, err := c.EnqueueTx(ctx, tx, keyed(fmt.Sprintf("c%d-", i), 200)...); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	if n := advisoryLocks(t, tx); n > maxKeyLocks {
		t.Fatalf("the transaction holds %d advisory locks, want at most %d", n, maxKeyLocks)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, db, "msg_key IS NOT NULL"); n != 20_000 {
		t.Fatalf("rows = %d, want 20000", n)
	}
}

// A rollback to a savepoint releases the locks taken since and restores the count: the budget
// is the transaction's again.
func TestKeyLockBudgetAfterRollbackToSavepoint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	q := store.New(db.Schema)
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	sp, err := tx.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.EnqueueTx(ctx, sp, keyed("a-", 200)...); err != nil {
		t.Fatal(err)
	}
	if err := sp.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := advisoryLocks(t, tx); n != 0 {
		t.Fatalf("%d advisory locks after the rollback to the savepoint, want 0", n)
	}
	// 200 more keys fit in the budget: exact locks, not buckets.
	if _, err := c.EnqueueTx(ctx, tx, keyed("b-", 200)...); err != nil {
		t.Fatal(err)
	}
	var exact, exclusiveBuckets int
	if err := tx.QueryRow(ctx, `SELECT count(*) FILTER (WHERE classid = $1::int8::oid),
			count(*) FILTER (WHERE classid = $2::int8::oid AND mode = 'ExclusiveLock')
		FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()`,
		q.KeyLockClass, q.KeyBucketLockClass).Scan(&exact, &exclusiveBuckets); err != nil {
		t.Fatal(err)
	}
	if exact != 200 || exclusiveBuckets != 0 {
		t.Fatalf("%d key locks and %d exclusive bucket locks, want 200 and 0", exact, exclusiveBuckets)
	}
}

// sameBucket returns a key other than key whose hash falls in key's bucket.
func sameBucket(key string) string {
	want := store.KeyHash(key) % store.KeyLockBuckets
	for i := 0; ; i++ {
		k := fmt.Sprintf("other-%d", i)
		if store.KeyHash(k) != store.KeyHash(key) && store.KeyHash(k)%store.KeyLockBuckets == want {
			return k
		}
	}
}

// bigCall returns a call that exceeds the budget (bucket mode) and includes key.
func bigCall(key string) []outbox.Message {
	return append(keyed("bulk-", store.KeyLockBudget), outbox.Message{Subject: "k.v", Key: key})
}

// waitBucket waits until the backend pid waits on a bucket lock (with two bucket-mode calls
// the first bucket they share, which need not be the key's).
func waitBucket(t *testing.T, db *testsvc.DB, pid uint32) {
	t.Helper()
	waitAdvisory(t, db, pid, store.New(db.Schema).KeyBucketLockClass, "a bucket lock")
}

// waitKeyLock waits until the backend pid waits on a key's exact lock.
func waitKeyLock(t *testing.T, db *testsvc.DB, pid uint32) {
	t.Helper()
	waitAdvisory(t, db, pid, store.New(db.Schema).KeyLockClass, "a key lock")
}

// waitAdvisory waits until the backend pid waits on an advisory lock of class.
func waitAdvisory(t *testing.T, db *testsvc.DB, pid uint32, class int32, what string) {
	t.Helper()
	testsvc.Eventually(t, 10*time.Second, fmt.Sprintf("backend %d to wait on %s", pid, what), func() bool {
		var waiting bool
		_ = db.AdminPool.QueryRow(context.Background(), `SELECT count(*) > 0 FROM pg_stat_activity a JOIN pg_locks l USING (pid)
			WHERE a.pid = $1 AND a.wait_event_type = 'Lock' AND a.wait_event = 'advisory'
			  AND l.locktype = 'advisory' AND NOT l.granted AND l.classid = $2::int8::oid AND l.objsubid = 2`,
			pid, class).Scan(&waiting)
		return waiting
	})
}

func beginTx(t *testing.T, db *testsvc.DB) pgx.Tx {
	t.Helper()
	tx, err := db.Pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

// keyID returns the row id of key's message among ids.
func keyID(t *testing.T, db *testsvc.DB, key string, ids ...uuid.UUID) int64 {
	t.Helper()
	var id int64
	if err := db.Pool.QueryRow(context.Background(), `SELECT id FROM txoutbox_messages WHERE msg_key = $1 AND message_id = ANY($2::uuid[])`,
		key, ids).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// A transaction writing a key waits for the open transaction that wrote it first, whichever
// of them locks exactly and whichever locks buckets (it waits on the key's bucket: shared
// against exclusive), and draws a later id.
func TestKeyOrderAcrossLockModes(t *testing.T) {
	t.Parallel()
	one := func(k string) []outbox.Message { return []outbox.Message{{Subject: "k.v", Key: k}} }
	for _, tc := range []struct {
		name         string
		first, later func(key string) []outbox.Message
		waitsOnKey   bool // the later transaction waits on the key's own lock, not its bucket
	}{
		{"exact then exact", one, one, true},
		{"exact then bucket", one, bigCall, false},
		{"bucket then exact", bigCall, one, false},
		{"bucket then bucket", bigCall, bigCall, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := testsvc.NewDB(t)
			c := newClient(t, db, nil)
			const key = "order-1"
			a := beginTx(t, db)
			aIDs, err := c.EnqueueTx(ctx, a, tc.first(key)...)
			if err != nil {
				t.Fatal(err)
			}
			b := beginTx(t, db)
			var pid uint32
			if err := b.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
				t.Fatal(err)
			}
			type result struct {
				ids []uuid.UUID
				err error
			}
			done := make(chan result, 1)
			go func() {
				ids, err := c.EnqueueTx(ctx, b, tc.later(key)...)
				done <- result{ids, err}
			}()
			if tc.waitsOnKey {
				waitKeyLock(t, db, pid)
			} else {
				waitBucket(t, db, pid)
			}
			select {
			case r := <-done:
				t.Fatalf("the second transaction enqueued while the first held the key: %v", r.err)
			default:
			}
			if err := a.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			r := <-done
			if r.err != nil {
				t.Fatal(r.err)
			}
			if err := b.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if ida, idb := keyID(t, db, key, aIDs...), keyID(t, db, key, r.ids...); idb <= ida {
				t.Fatalf("key %s: id %d committed after id %d", key, idb, ida)
			}
		})
	}
}

// Two exact-mode transactions whose keys share a bucket do not wait for each other.
func TestKeysOfOneBucketDoNotWaitInExactMode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	const key = "order-1"
	other := sameBucket(key)
	a := beginTx(t, db)
	if _, err := c.EnqueueTx(ctx, a, outbox.Message{Subject: "k.v", Key: key}); err != nil {
		t.Fatal(err)
	}
	b := beginTx(t, db)
	// Bounded so that a regression fails instead of hanging: the call must not wait at all.
	bctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := c.EnqueueTx(bctx, b, outbox.Message{Subject: "k.v", Key: other}); err != nil {
		t.Fatalf("enqueue %s (same bucket as %s, held by an open transaction): %v", other, key, err)
	}
	if err := b.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// Committing a half message serialises with EnqueueTx of its key in bucket mode, both ways.
func TestHalfCommitAndBucketMode(t *testing.T) {
	t.Parallel()
	const key = "order-1"
	t.Run("commit waits for a bucket-mode enqueue", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		db := testsvc.NewDB(t)
		c := newClient(t, db, nil)
		q := store.New(db.Schema)
		h, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "k.v", Key: key}, &outbox.PrepareOptions{Group: "g"})
		if err != nil {
			t.Fatal(err)
		}
		a := beginTx(t, db)
		ids, err := c.EnqueueTx(ctx, a, bigCall(key)...)
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- c.Commit(ctx, db.Pool, h.ID) }()
		testsvc.Eventually(t, 10*time.Second, "the commit to wait on the key's bucket", func() bool {
			var n int
			_ = db.AdminPool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
				AND classid = $1::int8::oid AND objid = $2::int8::oid AND objsubid = 2`,
				q.KeyBucketLockClass, store.KeyHash(key)%store.KeyLockBuckets).Scan(&n)
			return n > 0
		})
		select {
		case err := <-done:
			t.Fatalf("commit returned while the key's bucket was held: %v", err)
		default:
		}
		if err := a.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if ida, idh := keyID(t, db, key, ids[len(ids)-1]), keyID(t, db, key, h.ID); idh <= ida {
			t.Fatalf("half message id %d, want above %d (committed later)", idh, ida)
		}
	})
	t.Run("bucket-mode enqueue waits for CommitTx", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		db := testsvc.NewDB(t)
		c := newClient(t, db, nil)
		h, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "k.v", Key: key}, &outbox.PrepareOptions{Group: "g"})
		if err != nil {
			t.Fatal(err)
		}
		a := beginTx(t, db)
		if err := c.CommitTx(ctx, a, h.ID); err != nil {
			t.Fatal(err)
		}
		b := beginTx(t, db)
		var pid uint32
		if err := b.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			t.Fatal(err)
		}
		type result struct {
			ids []uuid.UUID
			err error
		}
		done := make(chan result, 1)
		go func() {
			ids, err := c.EnqueueTx(ctx, b, bigCall(key)...)
			done <- result{ids, err}
		}()
		waitBucket(t, db, pid)
		select {
		case r := <-done:
			t.Fatalf("enqueue returned while CommitTx held the key: %v", r.err)
		default:
		}
		if err := a.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		r := <-done
		if r.err != nil {
			t.Fatal(r.err)
		}
		if err := b.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if idh, idb := keyID(t, db, key, h.ID), keyID(t, db, key, r.ids...); idb <= idh {
			t.Fatalf("enqueued id %d, want above the half message's %d (committed later)", idb, idh)
		}
	})
}

// When PostgreSQL's shared lock table is full, EnqueueTx and CommitTx of a keyed message fail
// with ErrLockTableFull (the server's 53200 wrapped, errors.As still finds it), saying what
// fills the table and how to make room, and write nothing; once locks are released they work
// again. It runs on a throwaway cluster of its own: filling the lock table of the shared test
// server would make every other session on it fail.
func TestLockTableFullIsNamed(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster of its own")
	}
	ctx := context.Background()
	pg, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{})
	if errors.Is(err, embedded.ErrNoPostgresBinaries) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Stop)
	pool, err := pgxpool.New(ctx, pg.DSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	const schema = "app"
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx, pool); err != nil {
		t.Fatal(err)
	}
	c, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	half, err := c.Prepare(ctx, pool, outbox.Message{Subject: "k.v", Key: "half-key"}, &outbox.PrepareOptions{Group: "g"})
	if err != nil {
		t.Fatal(err)
	}
	// The transactions that will meet the full table begin first (beginning takes no lock).
	enq, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer enq.Rollback(ctx)
	com, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer com.Rollback(ctx)

	// Fill the lock table: advisory locks in ever smaller steps, each step in a savepoint
	// rolled back when the table has no room for it.
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	held := 0
	for _, step := range []int{4096, 512, 64, 8, 1} {
		for {
			if _, err := holder.Exec(ctx, "SAVEPOINT fill"); err != nil {
				t.Fatal(err)
			}
			_, err := holder.Exec(ctx, "SELECT count(pg_advisory_xact_lock(7, g)) FROM generate_series($1::int, $2::int) g", held, held+step-1)
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "53200" {
				if _, err := holder.Exec(ctx, "ROLLBACK TO SAVEPOINT fill"); err != nil {
					t.Fatal(err)
				}
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			held += step
			if held > 1_000_000 {
				t.Fatal("the lock table never filled")
			}
		}
	}
	t.Logf("the lock table is full with %d advisory locks of one session", held)

	check := func(what string, err error) {
		t.Helper()
		var pgErr *pgconn.PgError
		if !errors.Is(err, outbox.ErrLockTableFull) || !errors.As(err, &pgErr) || pgErr.Code != "53200" {
			t.Fatalf("%s: %v, want ErrLockTableFull wrapping the server's 53200", what, err)
		}
		for _, want := range []string{"max_locks_per_transaction", "max_connections", "KeyLockBudget", "512"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: %q does not say %s", what, err, want)
			}
		}
	}
	_, err = c.EnqueueTx(ctx, enq, keyed("full-", 3)...)
	check("EnqueueTx", err)
	check("CommitTx", c.CommitTx(ctx, com, half.ID))
	_ = enq.Rollback(ctx)
	_ = com.Rollback(ctx)
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	// Room again: the same calls succeed; nothing of the failed ones was written.
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM app.txoutbox_messages WHERE state <> 'prepared'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d rows written by the failed calls (%v)", n, err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := c.EnqueueTx(ctx, tx, keyed("full-", 3)...); err != nil {
			return err
		}
		return c.CommitTx(ctx, tx, half.ID)
	})
	if err != nil {
		t.Fatal(err)
	}
}
