package demo

import (
	"context"
	"math/rand/v2"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox"
)

// crashAfterCommit is the database handle the demo's consumer gets when it is to crash between
// its commit and its ack: after a transaction begun on it commits, crash runs with probability
// p — the consumer's effect and dedup row are durable and its ack has not left, as when a
// process dies there. It works through the consumer's public API (consumer.New takes any
// txoutbox.Beginner), so no fault point has to be compiled into the consumer.
type crashAfterCommit struct {
	db    txoutbox.Beginner
	p     float64
	crash func()
}

func (c *crashAfterCommit) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := c.db.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &crashTx{Tx: tx, c: c}, nil
}

type crashTx struct {
	pgx.Tx
	c *crashAfterCommit
}

func (t *crashTx) Commit(ctx context.Context) error {
	err := t.Tx.Commit(ctx)
	if err == nil && rand.Float64() < t.c.p {
		t.c.crash()
	}
	return err
}
