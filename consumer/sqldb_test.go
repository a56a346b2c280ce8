package consumer

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"
	"github.com/jmoiron/sqlx"
	_ "github.com/lib/pq" // database/sql driver "postgres"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"
)

var sqlDrivers = []string{"pgx", "postgres"}

// openSQL opens e's schema through database/sql with driver.
func (e *env) openSQL(driver string) *sql.DB {
	e.t.Helper()
	sdb, err := sql.Open(driver, e.db.DSN)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = sdb.Close() })
	return sdb
}

func (e *env) newSQLConsumer(sdb *sql.DB, cfg *Config, h SQLHandler) *Consumer {
	e.t.Helper()
	c, err := NewSQL(sdb, e.nats.JS, h, e.config(cfg))
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

// recordEffectSQL is recordEffect through database/sql.
func recordEffectSQL(ctx context.Context, tx *sql.Tx, msg Message) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO effects (idem, subject, payload, delivery) VALUES ($1, $2, $3, $4)`,
		msg.IdempotencyKey, msg.Subject, string(msg.Payload), msg.Delivery)
	return err
}

// A consumer on a *sql.DB, with either driver: every message has its effect exactly once,
// although some acks are lost (the redelivery is skipped as a duplicate) and some messages
// are stored twice in the stream; and each dedup row commits with its effect.
func TestSQLConsumerExactlyOnce(t *testing.T) {
	t.Parallel()
	for _, driver := range sqlDrivers {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			c := e.newSQLConsumer(e.openSQL(driver), &Config{Concurrency: 4, AckWait: 500 * time.Millisecond}, recordEffectSQL)
			var mu sync.Mutex
			lost := map[string]bool{}
			c.hooks.afterCommit = func(_ context.Context, msgs []Message) error {
				mu.Lock()
				defer mu.Unlock()
				// Every fifth message: a crash between the commit and the ack, once.
				if k := msgs[0].IdempotencyKey; len(lost) < 4 && !lost[k] && len(k)%5 == 0 {
					lost[k] = true
					return errors.New("crash before the ack")
				}
				return nil
			}
			const n = 40
			for i := range n {
				e.publishID("orders.created", fmt.Sprintf("id-%d", i), fmt.Sprintf("order %d", i))
			}
			// The same business event under two more message ids.
			for range 2 {
				e.publish("orders.created", map[string][]string{"Nats-Msg-Id": {newID()}, "Txoutbox-Biz-Key": {"order:x"}}, "x")
			}
			e.run(c)
			e.waitEffects(n + 1)
			testsvc.Eventually(t, 20*time.Second, "all acked", func() bool {
				info := e.consumerInfo(testDurable)
				return info.NumAckPending == 0 && info.NumPending == 0
			})
			mu.Lock()
			nLost := len(lost)
			mu.Unlock()
			if got := e.count(`SELECT count(*) FROM (SELECT idem FROM effects GROUP BY idem HAVING count(*) > 1) d`); got != 0 {
				t.Fatalf("%d messages with more than one effect", got)
			}
			if st := c.Stats(); st.Processed != n+1 || st.Duplicates != int64(1+nLost) {
				t.Fatalf("stats %+v: want %d processed and %d duplicates (%d lost acks and a business key twice)", st, n+1, 1+nLost, nLost)
			}
			if got := e.count(`SELECT count(*) FROM txoutbox_consumer_dedup WHERE consumer = $1`, testDurable); got != n+1 {
				t.Fatalf("dedup rows: %d, want %d", got, n+1)
			}
		})
	}
}

// A handler error rolls back its effect and the dedup row together: the retry runs the
// handler again (it is no duplicate) and its effect is the only one. A handler that swallows a
// statement's error is caught at the commit (errTxAborted); one that commits the transaction
// itself gets ErrTxControl.
func TestSQLConsumerHandlerErrors(t *testing.T) {
	t.Parallel()
	for _, driver := range sqlDrivers {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ctx := context.Background()
			mode := "fail"
			h := func(ctx context.Context, tx *sql.Tx, msg Message) error {
				if err := recordEffectSQL(ctx, tx, msg); err != nil {
					return err
				}
				switch mode {
				case "fail":
					return errors.New("business rule says no")
				case "swallow":
					_, _ = tx.ExecContext(ctx, `SELECT 1/0`) // error ignored: the transaction is aborted
				case "commit":
					return tx.Commit()
				}
				return nil
			}
			c := e.newSQLConsumer(e.openSQL(driver), &Config{AckWait: 300 * time.Millisecond}, h)
			e.publishID("orders.created", "id-1", "x")
			dedup := func() int {
				return e.count(`SELECT count(*) FROM txoutbox_consumer_dedup WHERE consumer = $1`, testDurable)
			}

			for _, m := range []string{"fail", "swallow"} {
				mode = m
				r := c.handleOne(ctx, e.fetch(c, 1)[0])
				if r.outcome != outcomeRetry {
					t.Fatalf("%s: %v (%v), want retry", m, r.outcome, r.err)
				}
				if m == "swallow" && !errors.Is(r.err, errTxAborted) {
					t.Fatalf("swallowed error: %v, want errTxAborted", r.err)
				}
				if n, d := e.effects(), dedup(); n != 0 || d != 0 {
					t.Fatalf("%s: after the failure %d effects and %d dedup rows, want none", m, n, d)
				}
			}
			mode = "ok"
			if r := c.handleOne(ctx, e.fetch(c, 1)[0]); r.outcome != outcomeProcessed {
				t.Fatalf("third delivery: %v (%v)", r.outcome, r.err)
			}
			if n, d := e.effectsOf("id-1"), dedup(); n != 1 || d != 1 {
				t.Fatalf("after the success: %d effects and %d dedup rows, want 1 and 1", n, d)
			}
			var delivery int
			if err := e.db.Pool.QueryRow(ctx, `SELECT delivery FROM effects`).Scan(&delivery); err != nil || delivery != 3 {
				t.Fatalf("the effect is of delivery %d (%v), want 3", delivery, err)
			}

			// A handler that commits the consumer's transaction.
			mode = "commit"
			e.publishID("orders.created", "id-2", "y")
			r := c.handleOne(ctx, e.fetch(c, 1)[0])
			if r.outcome != outcomeRetry || !errors.Is(r.err, ErrTxControl) {
				t.Fatalf("handler committed: %v (%v), want a retry with ErrTxControl", r.outcome, r.err)
			}
			// It did commit (dedup row and effect): the redelivery is a duplicate, not a
			// second effect.
			mode = "ok"
			if r := c.handleOne(ctx, e.fetch(c, 1)[0]); r.outcome != outcomeDuplicate {
				t.Fatalf("redelivery after the handler's own commit: %v (%v), want duplicate", r.outcome, r.err)
			}
			if n := e.effectsOf("id-2"); n != 1 {
				t.Fatalf("effects of id-2: %d, want 1", n)
			}
		})
	}
}

// NewSQL refuses what it cannot do, naming the field.
func TestNewSQLConfig(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	sdb := e.openSQL("pgx")
	for _, cfg := range []*Config{{BatchSize: 2}, {BatchSize: 2, Ordered: true}} {
		_, err := NewSQL(sdb, e.nats.JS, recordEffectSQL, e.config(cfg))
		var ce *txoutbox.ConfigError
		if !errors.As(err, &ce) {
			t.Fatalf("%+v: %v, want a *txoutbox.ConfigError", cfg, err)
		}
	}
	if _, err := NewSQL(nil, e.nats.JS, recordEffectSQL, e.config(nil)); err == nil {
		t.Fatal("nil db accepted")
	}
}

// The handler's *sql.Tx wrapped as the README says: an sqlx transaction and a GORM session on
// it write in the consumer's transaction (committed with the dedup row, rolled back with it).
func TestSQLConsumerHandlerWithSqlxAndGorm(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	fail := true
	sdb := e.openSQL("pgx")
	sqlxDB := sqlx.NewDb(sdb, "pgx")
	h := func(ctx context.Context, tx *sql.Tx, msg Message) error {
		stx := &sqlx.Tx{Tx: tx, Mapper: sqlxDB.Mapper}
		if _, err := stx.ExecContext(ctx, `INSERT INTO effects (idem, subject, payload, delivery, note) VALUES ($1, $2, $3, $4, 'sqlx')`,
			msg.IdempotencyKey, msg.Subject, string(msg.Payload), msg.Delivery); err != nil {
			return err
		}
		var n int
		if err := stx.GetContext(ctx, &n, `SELECT count(*) FROM effects WHERE idem = $1`, msg.IdempotencyKey); err != nil || n != 1 {
			return fmt.Errorf("sqlx sees %d effects (%v), want its own one", n, err)
		}
		gdb, err := gorm.Open(postgres.New(postgres.Config{Conn: tx}), &gorm.Config{Logger: logger.Discard})
		if err != nil {
			return err
		}
		if err := gdb.WithContext(ctx).Exec(`INSERT INTO effects (idem, subject, payload, delivery, note) VALUES (?, ?, ?, ?, 'gorm')`,
			msg.IdempotencyKey, msg.Subject, string(msg.Payload), msg.Delivery).Error; err != nil {
			return err
		}
		if fail {
			return errors.New("no")
		}
		return nil
	}
	c := e.newSQLConsumer(sdb, &Config{AckWait: 300 * time.Millisecond}, h)
	e.publishID("orders.created", "id-1", "x")
	if r := c.handleOne(ctx, e.fetch(c, 1)[0]); r.outcome != outcomeRetry {
		t.Fatalf("first delivery: %v (%v), want retry", r.outcome, r.err)
	}
	if n := e.effects(); n != 0 {
		t.Fatalf("effects after the failure: %d, want 0 (sqlx's and GORM's rolled back with the transaction)", n)
	}
	fail = false
	if r := c.handleOne(ctx, e.fetch(c, 1)[0]); r.outcome != outcomeProcessed {
		t.Fatalf("second delivery: %v (%v)", r.outcome, r.err)
	}
	if n := e.count(`SELECT count(DISTINCT note) FROM effects WHERE idem = 'id-1'`); n != 2 {
		t.Fatalf("notes of the effects: %d, want sqlx and gorm", n)
	}
}

// A NewSQL consumer holds one connection at a time per handling: with a pool of one
// connection, an ordered consumer dead-letters keyed messages (a permanent failure, a key
// moved past it) — whose key it advances in a transaction of its own — applies the others,
// and settles them all.
func TestSQLOrderedDeadLettersWithAPoolOfOne(t *testing.T) {
	t.Parallel()
	for _, driver := range sqlDrivers {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			sdb := e.openSQL(driver)
			sdb.SetMaxOpenConns(1)
			e.publish("orders.created", map[string][]string{"Nats-Msg-Id": {newID()}, "Txoutbox-Key": {"k"}}, "poison")
			e.publish("orders.created", map[string][]string{"Nats-Msg-Id": {newID()}, "Txoutbox-Key": {"k"}}, "ok")
			lost := e.publish("orders.created", map[string][]string{"Nats-Msg-Id": {newID()}, "Txoutbox-Key": {"j"}}, "lost")
			e.exec(`INSERT INTO txoutbox_consumer_key_order (consumer, stream, order_key, applied_seq) VALUES ($1, $2, 'j', $3)`,
				testDurable, testStream, int64(lost.Sequence)+10)
			c := e.newSQLConsumer(sdb, &Config{Ordered: true, Concurrency: 1}, func(ctx context.Context, tx *sql.Tx, msg Message) error {
				if string(msg.Payload) == "poison" {
					return Permanent(errors.New("poison"))
				}
				return recordEffectSQL(ctx, tx, msg)
			})
			e.run(c)
			testsvc.Eventually(t, 20*time.Second, "two dead letters and one effect", func() bool {
				return len(e.deadLetters()) == 2 && e.effects() == 1
			})
			testsvc.Eventually(t, 20*time.Second, "every message settled", func() bool {
				info := e.consumerInfo(testDurable)
				return info.NumAckPending == 0 && info.NumPending == 0
			})
			if n := e.effects(); n != 1 {
				t.Fatalf("%d effects, want 1 (ok)", n)
			}
		})
	}
}
