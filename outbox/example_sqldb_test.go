package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"; lib/pq works the same
	"github.com/jmoiron/sqlx"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"
)

// migrateOutbox creates the outbox's tables in schema: at deploy time, `relay migrate up`
// does the same.
func migrateOutbox(ctx context.Context, databaseURL, schema string) error {
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		return err
	}
	_, err = m.Up(ctx, pool)
	return err
}

// An sqlx transaction: the business row and its event commit together. *sqlx.Tx is a
// *sql.Tx, which EnqueueSQLTx takes as it is.
func ExampleClient_EnqueueSQLTx_sqlx() {
	ctx := context.Background()
	schema := os.Getenv("TXOUTBOX_SCHEMA")
	if err := migrateOutbox(ctx, os.Getenv("DATABASE_URL"), schema); err != nil {
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
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+schema+`.invoices (id text PRIMARY KEY, total_cents int)`); err != nil {
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
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+schema+`.invoices VALUES ($1, $2)`, "inv-7", 4200); err != nil {
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
	if err := db.GetContext(ctx, &state, `SELECT state FROM `+schema+`.txoutbox_messages WHERE message_id = $1`, ids[0].String()); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(state)
	// Output: ready
}

// Shipment is a GORM model.
type Shipment struct {
	ID      string `gorm:"primaryKey"`
	Carrier string
}

// A GORM transaction: the event is enqueued on the transaction's connection,
// tx.Statement.ConnPool (the *sql.Tx GORM runs the transaction on).
func ExampleClient_EnqueueSQLTx_gorm() {
	ctx := context.Background()
	schema := os.Getenv("TXOUTBOX_SCHEMA")
	if err := migrateOutbox(ctx, os.Getenv("DATABASE_URL"), schema); err != nil {
		fmt.Println(err)
		return
	}
	gdb, err := gorm.Open(postgres.Open(os.Getenv("DATABASE_URL")), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		fmt.Println(err)
		return
	}
	shipments := gdb.Table(schema + ".shipments")
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
		if err := tx.Table(schema + ".shipments").Create(&Shipment{ID: "shp-1", Carrier: "DHL"}).Error; err != nil {
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
