package outbox_test

// The producer over database/sql (EnqueueSQLTx and the half-message methods), with pgx's
// stdlib driver and lib/pq: the same outcomes, rows and key order as the pgx methods.

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"
	_ "github.com/lib/pq"              // database/sql driver "postgres"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// sqlDrivers are the database/sql drivers every database/sql test runs with: pgx's stdlib
// driver, lib/pq, and lib/pq sending []byte arguments in binary (binary_parameters=yes, one
// round trip per statement).
var sqlDrivers = []string{"pgx", "postgres", "postgres+binary_parameters"}

// openSQL opens db's schema through database/sql with driver (one of sqlDrivers).
func openSQL(t testing.TB, db *testsvc.DB, driver string) *sql.DB {
	t.Helper()
	dsn := db.DSN
	if name, ok := strings.CutSuffix(driver, "+binary_parameters"); ok {
		driver, dsn = name, dsn+"&binary_parameters=yes"
	}
	sdb, err := sql.Open(driver, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sdb.Close() })
	if err := sdb.PingContext(context.Background()); err != nil {
		t.Fatalf("%s: %v", driver, err)
	}
	return sdb
}

func beginSQL(t testing.TB, sdb *sql.DB) *sql.Tx {
	t.Helper()
	tx, err := sdb.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

// readStoredSQL is readStored through database/sql.
func readStoredSQL(t *testing.T, ctx context.Context, tx *sql.Tx, id uuid.UUID) storedRow {
	t.Helper()
	var r storedRow
	var hdr []byte
	if err := tx.QueryRowContext(ctx, `SELECT subject, coalesce(msg_key, '<NULL>'), partition_key, headers, payload, state,
    coalesce(to_char(deliver_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US'), '<NULL>'), ready_at IS NOT NULL
FROM txoutbox_messages WHERE message_id = $1`, id.String()).
		Scan(&r.Subject, &r.Key, &r.Partition, &hdr, &r.Payload, &r.State, &r.DeliverAt, &r.ReadyAt); err != nil {
		t.Fatalf("read %s: %v", id, err)
	}
	if hdr != nil {
		if err := json.Unmarshal(hdr, &r.Headers); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

func sameStored(a, b storedRow) bool {
	return fmt.Sprintf("%+v", a) == fmt.Sprintf("%+v", b) && bytes.Equal(a.Payload, b.Payload)
}

// The agreement table of the SQL contract (agreementRows) through EnqueueSQLTx with each
// driver: the outcome EnqueueTx has (accepted, or the same sentinel in a *MessageError), and
// an accepted message stored exactly as EnqueueTx stores it.
func TestEnqueueSQLTxAgreesWithEnqueueTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	for _, driver := range sqlDrivers {
		t.Run(driver, func(t *testing.T) {
			sdb := openSQL(t, db, driver)
			for _, row := range agreementRows() {
				m := row.m
				if m.ID == uuid.Nil {
					m.ID = uuid.Must(uuid.NewV7())
				}
				var goRow *storedRow
				var goErr error
				err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
					if row.dup {
						if _, err := c.EnqueueTx(ctx, tx, m); err != nil {
							return err
						}
					}
					ids, err := c.EnqueueTx(ctx, tx, m)
					if goErr = err; err == nil {
						r := readStored(t, ctx, tx, ids[0])
						goRow = &r
					}
					return errRollback
				})
				if !errors.Is(err, errRollback) {
					t.Fatalf("%s: EnqueueTx side: %v", row.name, err)
				}
				tx := beginSQL(t, sdb)
				if row.dup {
					if _, err := c.EnqueueSQLTx(ctx, tx, m); err != nil {
						t.Fatalf("%s: first enqueue: %v", row.name, err)
					}
				}
				ids, err := c.EnqueueSQLTx(ctx, tx, m)
				got := goOutcome(err)
				if err == nil {
					if len(ids) != 1 || ids[0] != m.ID {
						t.Errorf("%s: EnqueueSQLTx returned %v, want [%s]", row.name, ids, m.ID)
					}
					r := readStoredSQL(t, ctx, tx, ids[0])
					if goRow == nil || !sameStored(r, *goRow) {
						t.Errorf("%s: EnqueueSQLTx stored %+v, EnqueueTx %+v", row.name, r, goRow)
					}
				}
				_ = tx.Rollback()
				if g := goOutcome(goErr); got != g || g != row.want {
					t.Errorf("%s: EnqueueSQLTx: %s (%v), EnqueueTx: %s, want %s", row.name, got, err, g, row.want)
				}
				var me *outbox.MessageError
				if err != nil && !errors.As(err, &me) {
					t.Errorf("%s: EnqueueSQLTx: %T %v, want a *MessageError", row.name, err, err)
				}
				if me != nil && (me.Index != 0 || me.ID != row.m.ID && row.m.ID != uuid.Nil) {
					t.Errorf("%s: the error names message %d (%s), want 0 (%s)", row.name, me.Index, me.ID, row.m.ID)
				}
			}
		})
	}
}

// errRollback makes pgx.BeginFunc roll back.
var errRollback = errors.New("roll back")

// A batch commits with the caller's transaction, in the caller's order; a rolled-back
// transaction leaves no row; a duplicate id inside a call or already stored is ErrDuplicateID
// naming the message.
func TestEnqueueSQLTxCommitRollback(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	for _, driver := range sqlDrivers {
		t.Run(driver, func(t *testing.T) {
			sdb := openSQL(t, db, driver)
			var msgs []outbox.Message
			for i := range 50 {
				m := outbox.Message{Subject: "orders.created", Payload: []byte{byte(i), 0, '"', '\\', '{'}}
				if i%3 != 0 {
					m.Key = fmt.Sprintf(`order "%d", {x}\`, i%7)
				}
				if i%5 == 0 {
					m.Headers = map[string][]string{"traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, "X-Quote": {`"q" \ ,{}`}}
					m.BizKey = fmt.Sprintf("biz,%d", i)
				}
				msgs = append(msgs, m)
			}
			tx := beginSQL(t, sdb)
			ids, err := c.EnqueueSQLTx(ctx, tx, msgs...)
			if err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			rows, err := db.Pool.Query(ctx, `SELECT message_id, payload FROM txoutbox_messages WHERE message_id = ANY($1::uuid[]) ORDER BY id`, ids)
			if err != nil {
				t.Fatal(err)
			}
			var got []uuid.UUID
			for rows.Next() {
				var id uuid.UUID
				var payload []byte
				if err := rows.Scan(&id, &payload); err != nil {
					t.Fatal(err)
				}
				if i := len(got); !bytes.Equal(payload, msgs[i].Payload) {
					t.Errorf("message %d: payload %q, want %q", i, payload, msgs[i].Payload)
				}
				got = append(got, id)
			}
			if err := rows.Err(); err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(got) != fmt.Sprint(ids) {
				t.Fatalf("ids in row order %v, want the call's order %v", got, ids)
			}

			// Rolled back: nothing.
			tx = beginSQL(t, sdb)
			rb, err := c.EnqueueSQLTx(ctx, tx, outbox.Message{Subject: "orders.created", Key: "k"}, outbox.Message{Subject: "orders.created"})
			if err != nil {
				t.Fatal(err)
			}
			if err := tx.Rollback(); err != nil {
				t.Fatal(err)
			}
			var n int
			if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages WHERE message_id = ANY($1::uuid[])`, rb).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n != 0 {
				t.Fatalf("%d rows of a rolled-back transaction", n)
			}

			// Duplicate ids.
			id := uuid.New()
			tx = beginSQL(t, sdb)
			_, err = c.EnqueueSQLTx(ctx, tx, outbox.Message{Subject: "a", ID: id}, outbox.Message{Subject: "b", ID: id})
			var me *outbox.MessageError
			if !errors.Is(err, outbox.ErrDuplicateID) || !errors.As(err, &me) || me.Index != 1 {
				t.Fatalf("same id twice in a call: %v, want a *MessageError for message 1 wrapping ErrDuplicateID", err)
			}
			_, err = c.EnqueueSQLTx(ctx, tx, outbox.Message{Subject: "a", ID: ids[3]})
			if !errors.Is(err, outbox.ErrDuplicateID) || !errors.As(err, &me) || me.Index != 0 || me.ID != ids[3] {
				t.Fatalf("id already stored: %v, want a *MessageError for message 0 (%s) wrapping ErrDuplicateID", err, ids[3])
			}
		})
	}
}

// pidSQL returns the backend pid of tx.
func pidSQL(t *testing.T, tx *sql.Tx) uint32 {
	t.Helper()
	var pid uint32
	if err := tx.QueryRowContext(context.Background(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	return pid
}

// EnqueueSQLTx locks the key before it draws the row's id, whatever the other producer uses:
// a transaction A (pgx) holds the key; B (database/sql) enqueues the key and waits on its
// lock; A enqueues the key once more and commits; B's row must come after A's second row. Had
// B drawn its id before waiting, it would sit between A's two rows. And the other way round,
// with bucket mode on the database/sql side.
func TestEnqueueSQLTxKeyOrder(t *testing.T) {
	t.Parallel()
	for _, driver := range sqlDrivers {
		for _, bucket := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/bucket=%v", driver, bucket), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				db := testsvc.NewDB(t)
				c := newClient(t, db, nil)
				sdb := openSQL(t, db, driver)
				const key = "order-1"
				one := []outbox.Message{{Subject: "k.v", Key: key}}
				later := one
				if bucket {
					later = bigCall(key)
				}
				a := beginTx(t, db)
				a1, err := c.EnqueueTx(ctx, a, one...)
				if err != nil {
					t.Fatal(err)
				}
				b := beginSQL(t, sdb)
				pid := pidSQL(t, b)
				type result struct {
					ids []uuid.UUID
					err error
				}
				done := make(chan result, 1)
				go func() {
					ids, err := c.EnqueueSQLTx(ctx, b, later...)
					if err == nil {
						err = b.Commit()
					}
					done <- result{ids, err}
				}()
				if bucket {
					waitBucket(t, db, pid)
				} else {
					waitKeyLock(t, db, pid)
				}
				a2, err := c.EnqueueTx(ctx, a, one...)
				if err != nil {
					t.Fatal(err)
				}
				if err := a.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				r := <-done
				if r.err != nil {
					t.Fatal(r.err)
				}
				first, second, late := keyID(t, db, key, a1...), keyID(t, db, key, a2...), keyID(t, db, key, r.ids...)
				if !(first < second && second < late) {
					t.Fatalf("row ids of the key: A %d, A %d, B %d: B waited for A and must come last", first, second, late)
				}
			})
		}
	}
}

// Concurrent producers of a few keys, through pgx, pgx's stdlib driver and lib/pq at once:
// for every key, row id order is commit order. Each transaction, after enqueueing, bumps its
// key's counter (a row lock held to the commit) and records the value beside its message: the
// counter follows commit order, so it must grow with the row id.
func TestEnqueueSQLTxConcurrentKeyOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE key_counter (k text PRIMARY KEY, n int NOT NULL);
		INSERT INTO key_counter SELECT 'key-' || g, 0 FROM generate_series(0, 3) g;
		CREATE TABLE key_commit (message_id uuid PRIMARY KEY, k text NOT NULL, n int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	sdbs := map[string]*sql.DB{}
	for _, d := range sqlDrivers {
		sdbs[d] = openSQL(t, db, d)
	}
	const producers, perProducer = 6, 25
	var wg sync.WaitGroup
	errs := make(chan error, producers)
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perProducer {
				key := fmt.Sprintf("key-%d", (p+i)%4)
				msg := outbox.Message{Subject: "k.v", Key: key}
				var err error
				switch p % 4 {
				case 0:
					err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
						ids, err := c.EnqueueTx(ctx, tx, msg)
						if err != nil {
							return err
						}
						var n int
						if err := tx.QueryRow(ctx, `UPDATE key_counter SET n = n + 1 WHERE k = $1 RETURNING n`, key).Scan(&n); err != nil {
							return err
						}
						_, err = tx.Exec(ctx, `INSERT INTO key_commit VALUES ($1, $2, $3)`, ids[0], key, n)
						return err
					})
				default:
					sdb := sdbs[sqlDrivers[p%4-1]]
					err = func() error {
						tx, err := sdb.BeginTx(ctx, nil)
						if err != nil {
							return err
						}
						defer func() { _ = tx.Rollback() }()
						ids, err := c.EnqueueSQLTx(ctx, tx, msg)
						if err != nil {
							return err
						}
						var n int
						if err := tx.QueryRowContext(ctx, `UPDATE key_counter SET n = n + 1 WHERE k = $1 RETURNING n`, key).Scan(&n); err != nil {
							return err
						}
						if _, err := tx.ExecContext(ctx, `INSERT INTO key_commit VALUES ($1, $2, $3)`, ids[0].String(), key, n); err != nil {
							return err
						}
						return tx.Commit()
					}()
				}
				if err != nil {
					errs <- fmt.Errorf("producer %d: %w", p, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var bad, total int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE n <> rn), count(*) FROM (
		SELECT kc.n, row_number() OVER (PARTITION BY kc.k ORDER BY m.id) AS rn
		FROM key_commit kc JOIN txoutbox_messages m USING (message_id)) x`).Scan(&bad, &total); err != nil {
		t.Fatal(err)
	}
	if total != producers*perProducer || bad != 0 {
		t.Fatalf("%d of %d messages out of commit order for their key (want %d messages, none out of order)", bad, total, producers*perProducer)
	}
}

// Half messages over database/sql: prepare, commit on its own or inside a business
// transaction, roll back; the same states and errors as the pgx methods.
func TestHalfMessagesSQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	state := func(id uuid.UUID) string {
		var s string
		if err := db.Pool.QueryRow(ctx, `SELECT state FROM txoutbox_messages WHERE message_id = $1`, id).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	for _, driver := range sqlDrivers {
		t.Run(driver, func(t *testing.T) {
			sdb := openSQL(t, db, driver)
			msg := outbox.Message{Subject: "orders.paid", Key: "order-" + driver, Payload: []byte("p")}

			// Prepare, then Commit on its own.
			h, err := c.PrepareSQL(ctx, sdb, msg, &outbox.PrepareOptions{Group: "orders"})
			if err != nil {
				t.Fatal(err)
			}
			if s := state(h.ID); s != "prepared" {
				t.Fatalf("after PrepareSQL: %s", s)
			}
			if err := c.CommitSQL(ctx, sdb, h.ID); err != nil {
				t.Fatal(err)
			}
			if s := state(h.ID); s != "ready" {
				t.Fatalf("after CommitSQL: %s", s)
			}
			var se *outbox.SettleError
			if err := c.CommitSQL(ctx, sdb, h.ID); !errors.Is(err, outbox.ErrAlreadyCommitted) || !errors.As(err, &se) || se.State != "ready" {
				t.Fatalf("second CommitSQL: %v, want a *SettleError (ready) wrapping ErrAlreadyCommitted", err)
			}
			if err := c.RollbackSQL(ctx, sdb, h.ID); !errors.Is(err, outbox.ErrAlreadyCommitted) {
				t.Fatalf("RollbackSQL of a committed message: %v", err)
			}
			_, err = c.PrepareSQL(ctx, sdb, outbox.Message{Subject: "a", ID: h.ID}, &outbox.PrepareOptions{Group: "orders"})
			var me *outbox.MessageError
			if !errors.Is(err, outbox.ErrDuplicateID) || !errors.As(err, &me) || me.Index != 0 || me.ID != h.ID || me.Subject != "a" {
				t.Fatalf("PrepareSQL of a stored id: %#v, want a *MessageError of message 0 wrapping ErrDuplicateID", err)
			}
			if _, err := c.PrepareSQL(ctx, sdb, msg, &outbox.PrepareOptions{Group: "no spaces"}); !errors.Is(err, outbox.ErrInvalidGroup) {
				t.Fatalf("PrepareSQL with a bad group: %v, want ErrInvalidGroup", err)
			}
			if _, err := c.PrepareSQL(ctx, sdb, msg, &outbox.PrepareOptions{Group: "orders", CheckImmunity: -1}); !errors.Is(err, txoutbox.ErrInvalidConfig) {
				t.Fatalf("PrepareSQL with a negative CheckImmunity: %v, want a ConfigError", err)
			}
			if _, err := c.PrepareSQL(ctx, sdb, outbox.Message{Subject: "a..b"}, &outbox.PrepareOptions{Group: "orders"}); !errors.Is(err, outbox.ErrInvalidSubject) {
				t.Fatalf("PrepareSQL with a bad subject: %v, want ErrInvalidSubject", err)
			}

			// Prepare, then roll back.
			h2, err := c.PrepareSQL(ctx, sdb, msg, &outbox.PrepareOptions{Group: "orders"})
			if err != nil {
				t.Fatal(err)
			}
			if err := c.RollbackSQL(ctx, sdb, h2.ID); err != nil {
				t.Fatal(err)
			}
			if s := state(h2.ID); s != "rolled_back" {
				t.Fatalf("after RollbackSQL: %s", s)
			}
			if err := c.CommitSQL(ctx, sdb, h2.ID); !errors.Is(err, outbox.ErrRolledBack) {
				t.Fatalf("CommitSQL of a rolled-back message: %v, want ErrRolledBack", err)
			}
			if err := c.CommitSQL(ctx, sdb, uuid.New()); !errors.Is(err, outbox.ErrNotFound) {
				t.Fatalf("CommitSQL of an unknown id: %v, want ErrNotFound", err)
			}

			// CommitSQLTx inside the business transaction: both or neither.
			h3, err := c.PrepareSQL(ctx, sdb, msg, &outbox.PrepareOptions{Fence: true})
			if err != nil {
				t.Fatal(err)
			}
			tx := beginSQL(t, sdb)
			if _, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES ($1)`, h3.ID.String()); err != nil {
				t.Fatal(err)
			}
			if err := c.CommitSQLTx(ctx, tx, h3.ID); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			if s := state(h3.ID); s != "ready" {
				t.Fatalf("after CommitSQLTx and commit: %s", s)
			}

			// The fence won (here: the message was rolled back first): CommitSQLTx fails and
			// so does the business transaction's commit.
			h4, err := c.PrepareSQL(ctx, sdb, msg, &outbox.PrepareOptions{Fence: true})
			if err != nil {
				t.Fatal(err)
			}
			if err := c.RollbackSQL(ctx, sdb, h4.ID); err != nil {
				t.Fatal(err)
			}
			tx = beginSQL(t, sdb)
			if _, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES ($1)`, h4.ID.String()); err != nil {
				t.Fatal(err)
			}
			if err := c.CommitSQLTx(ctx, tx, h4.ID); !errors.Is(err, outbox.ErrRolledBack) {
				t.Fatalf("CommitSQLTx of a fenced message: %v, want ErrRolledBack", err)
			}
			if err := tx.Commit(); err == nil {
				t.Fatal("the business transaction committed although its half message was rolled back")
			}
			var n int
			if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM orders WHERE id = $1`, h4.ID.String()).Scan(&n); err != nil || n != 0 {
				t.Fatalf("business rows of the failed transaction: %d (%v), want 0", n, err)
			}

			// SendInTransactionSQL.
			h5, st, err := c.SendInTransactionSQL(ctx, sdb, msg, &outbox.PrepareOptions{Group: "orders"},
				func(context.Context, outbox.Half) (outbox.LocalState, error) { return outbox.StateCommit, nil })
			if err != nil || st != outbox.StateCommit {
				t.Fatal(st, err)
			}
			if s := state(h5.ID); s != "ready" {
				t.Fatalf("after SendInTransactionSQL: %s", s)
			}
		})
	}
}

// The database/sql Postgres doorbell notifies its channel.
func TestPostgresSQLDoorbell(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db := testsvc.NewDB(t)
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	const channel = "sqldb_doorbell"
	if _, err := conn.Exec(ctx, "LISTEN "+channel); err != nil {
		t.Fatal(err)
	}
	for _, driver := range sqlDrivers {
		bell := outbox.NewPostgresSQLDoorbell(openSQL(t, db, driver), channel)
		bell.Ring()
		n, err := conn.Conn().WaitForNotification(ctx)
		bell.Close()
		if err != nil {
			t.Fatalf("%s: %v", driver, err)
		}
		if n.Channel != channel {
			t.Fatalf("%s: notified %q", driver, n.Channel)
		}
	}
}
