package consumer

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// New and NewBatch refuse a database handle that is one connection: the workers would share
// it (a consumer built on a *pgx.Conn with Concurrency 4 processed nothing, every message put
// back as an outage). The error is a *txoutbox.ConfigError naming db.
func TestNewRefusesSingleConnection(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for name, db := range testsvc.SingleConnections(t, e.db) {
		for ctor, build := range map[string]func() (*Consumer, error){
			"New":      func() (*Consumer, error) { return New(db, e.nats.JS, recordEffect, e.config(&Config{Concurrency: 4})) },
			"NewBatch": func() (*Consumer, error) { return NewBatch(db, e.nats.JS, recordEffects, e.config(nil)) },
		} {
			c, err := build()
			var ce *txoutbox.ConfigError
			if !errors.As(err, &ce) || ce.Field != "db" || ce.Package != "consumer" || !errors.Is(err, txoutbox.ErrInvalidConfig) {
				t.Errorf("%s(%s): consumer %v, err %v; want a *txoutbox.ConfigError naming db", ctor, name, c != nil, err)
			}
		}
	}
	// A pool, and a Beginner of the application's own wrapping it, are accepted.
	if _, err := New(e.db.Pool, e.nats.JS, recordEffect, e.config(&Config{Concurrency: 4})); err != nil {
		t.Errorf("New(pool): %v", err)
	}
	if _, err := NewBatch(wrappedPool{e.db}, e.nats.JS, recordEffects, e.config(&Config{Durable: "wrapped"})); err != nil {
		t.Errorf("NewBatch(a Beginner wrapping a pool): %v", err)
	}
}

// wrappedPool is an application's own Beginner over a pool.
type wrappedPool struct{ db *testsvc.DB }

func (w wrappedPool) Begin(ctx context.Context) (pgx.Tx, error) { return w.db.Pool.Begin(ctx) }
