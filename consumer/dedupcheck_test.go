package consumer

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/outbox"
)

// Every consumer refuses to start on a schema without the dedup table — a schema that was
// not migrated, or Config.Schema left at public while the outbox is elsewhere — with
// ErrDedupTable naming the schema, instead of starting and putting every message back as if
// the database were down, for ever. Run returns it, for New and NewSQL alike.
func TestConsumerNeedsDedupTable(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}}, "x")
	e.exec(`CREATE SCHEMA IF NOT EXISTS txoutbox_not_migrated`)
	t.Cleanup(func() { e.exec(`DROP SCHEMA IF EXISTS txoutbox_not_migrated CASCADE`) })
	cfg := func() *Config { c := e.config(&Config{}); c.Schema = "txoutbox_not_migrated"; return c }
	pgxC, err := New(e.db.Pool, e.nats.JS, recordEffect, cfg())
	if err != nil {
		t.Fatal(err)
	}
	sqlC, err := NewSQL(e.openSQL("postgres"), e.nats.JS, recordEffectSQL, cfg())
	if err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]*Consumer{"New": pgxC, "NewSQL": sqlC} {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		err := c.Run(ctx)
		cancel()
		if !errors.Is(err, ErrDedupTable) || !strings.Contains(err.Error(), `"txoutbox_not_migrated"`) {
			t.Fatalf("%s: Run on a schema without the dedup table: %v, want ErrDedupTable naming the schema", name, err)
		}
	}
	if e.effects() != 0 {
		t.Fatal("a message was applied")
	}
}
