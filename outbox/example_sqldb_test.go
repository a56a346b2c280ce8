package outbox_test

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"; lib/pq works the same
	"github.com/jmoiron/sqlx"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"
)

// An sqlx transaction: the business row and its event commit together. *sqlx.Tx is a
// *sql.Tx, which EnqueueSQLTx takes as it is.
func ExampleClient_EnqueueSQLTx_sqlx() {
	ctx := context.Background()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema)
	// At deploy time: the outbox's tables (relay migrate up does the same; it runs on pgx).
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := m.Up(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}
	db, err := sqlx.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() {
		if err := db.Close(); err != nil {
			fmt.Println(err)
		}
	}()
	// Identifiers are quoted (pgx.Identifier works for any driver's SQL).
	invoices := pgx.Identifier{schema, "invoices"}.Sanitize()
	messages := pgx.Identifier{schema, "txoutbox_messages"}.Sanitize()
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+invoices+` (id text PRIMARY KEY, total_cents int)`); err != nil {
		fmt.Println(err)
		return
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}

	var ids []uuid.UUID
	err = func() (err error) {
		tx, err := db.BeginTxx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() {
			if err != nil {
				err = errors.Join(err, tx.Rollback()) // the invoice and its event go together
			}
		}()
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+invoices+` VALUES ($1, $2)`, "inv-7", 4200); err != nil {
			return err
		}
		ids, err = client.EnqueueSQLTx(ctx, tx, outbox.Message{
			Subject: "invoices.issued",
			Key:     "inv-7",
			Payload: []byte(`{"total_cents":4200}`),
		})
		if err != nil {
			return err
		}
		return tx.Commit()
	}()
	if err != nil {
		fmt.Println(err)
		return
	}
	client.Ring() // wakes the relay when a doorbell is configured

	var state string
	if err := db.GetContext(ctx, &state, `SELECT state FROM `+messages+` WHERE message_id = $1`, ids[0].String()); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(state)
	// Output: ready
}

// A GORM transaction: the event is enqueued on the transaction's connection,
// tx.Statement.ConnPool (the *sql.Tx GORM runs the transaction on).
func ExampleClient_EnqueueSQLTx_gorm() {
	ctx := context.Background()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema)
	// At deploy time: the outbox's tables (relay migrate up does the same; it runs on pgx).
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := m.Up(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}
	gdb, err := gorm.Open(postgres.Open(os.Getenv("DATABASE_URL")), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		fmt.Println(err)
		return
	}
	// Shipment is a GORM model.
	type Shipment struct {
		ID      string `gorm:"primaryKey"`
		Carrier string
	}
	// GORM quotes a "schema.table" name part by part.
	shipmentsTable := schema + ".shipments"
	shipments := gdb.Table(shipmentsTable)
	if err := shipments.Migrator().CreateTable(&Shipment{}); err != nil {
		fmt.Println(err)
		return
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}

	err = gdb.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		if err := tx.Table(shipmentsTable).Create(&Shipment{ID: "shp-1", Carrier: "DHL"}).Error; err != nil {
			return err
		}
		_, err := client.EnqueueSQLTx(ctx, tx.Statement.ConnPool, outbox.Message{
			Subject: "shipments.created",
			Key:     "shp-1",
			Payload: []byte(`{"carrier":"DHL"}`),
		})
		return err // an error rolls back the shipment and the event together
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	client.Ring()

	var subjects []string
	if err := gdb.Table(schema+".txoutbox_messages").Where("msg_key = ?", "shp-1").Pluck("subject", &subjects).Error; err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(subjects)
	// Output: [shipments.created]
}

// Delayed messages over database/sql: an order's timeout is enqueued with the order, moved
// later, and withdrawn in the payment's transaction. RescheduleSQLTx, CancelBizKeySQLTx and
// RescheduleBizKeySQLTx work the same way; each is its pgx method with SQL in its name.
func ExampleClient_CancelSQLTx() {
	ctx := context.Background()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema)
	// At deploy time: the outbox's tables (relay migrate up does the same; it runs on pgx).
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := m.Up(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() {
		if err := db.Close(); err != nil {
			fmt.Println(err)
		}
	}()
	orders := pgx.Identifier{schema, "orders_sql_timeout"}.Sanitize() // quoted
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+orders+` (id text PRIMARY KEY, status text NOT NULL)`); err != nil {
		fmt.Println(err)
		return
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	// inTx runs f in a transaction: committed if f returns nil, rolled back otherwise.
	inTx := func(f func(tx *sql.Tx) error) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if err := f(tx); err != nil {
			return errors.Join(err, tx.Rollback())
		}
		return tx.Commit()
	}

	// Place the order: the order and its timeout commit together.
	orderID := uuid.NewString()
	due := time.Now().Add(30 * time.Minute).UTC().Truncate(time.Second)
	var timeoutID uuid.UUID
	err = inTx(func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+orders+` VALUES ($1, 'unpaid')`, orderID); err != nil {
			return err
		}
		ids, err := client.EnqueueSQLTx(ctx, tx, outbox.Message{
			Subject:   "orders.timeout",
			Key:       orderID,
			BizKey:    "order:" + orderID + ":timeout:" + due.Format(time.RFC3339),
			DeliverAt: due,
			Payload:   []byte(orderID),
		})
		if err != nil {
			return err
		}
		timeoutID = ids[0]
		return nil
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	// The customer is given 15 more minutes: the same timeout (same id, same business key)
	// falls due later.
	err = inTx(func(tx *sql.Tx) error {
		return client.RescheduleSQLTx(ctx, tx, timeoutID, due.Add(15*time.Minute))
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	// The customer pays: the order is paid and its timeout withdrawn, in one transaction.
	err = inTx(func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `UPDATE `+orders+` SET status = 'paid' WHERE id = $1 AND status = 'unpaid'`, orderID)
		if err != nil {
			return err
		}
		n, err := res.RowsAffected()
		if err != nil {
			return err
		}
		if n == 0 {
			return errors.New("the order was closed before it was paid: refund")
		}
		err = client.CancelSQLTx(ctx, tx, timeoutID)
		if errors.Is(err, outbox.ErrNotScheduled) {
			fmt.Println("the timeout went out already; its consumer will find the order paid")
			return nil
		}
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("paid; timeout cancelled")

	// Cancelling again: the timeout is no longer scheduled.
	err = client.CancelSQLTx(ctx, db, timeoutID)
	var se *outbox.ScheduleError
	if !errors.As(err, &se) {
		fmt.Println("second cancel:", err)
		return
	}
	fmt.Println("second cancel:", se.State, errors.Is(err, outbox.ErrNotScheduled))
	// Output:
	// paid; timeout cancelled
	// second cancel: rolled_back true
}
