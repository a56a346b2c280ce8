package consumer

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox/internal/testsvc"
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

// A role without USAGE on the outbox's schema (to_regclass itself is refused, 42501) is
// refused with ErrDedupTable too, naming the grants command, not taken for a database that
// does not answer (the consumer then started and put every message back for ever).
func TestConsumerRoleWithoutSchemaUsageIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	role := "txoutbox_nousage_" + strings.ReplaceAll(newID()[:8], "-", "")
	testsvc.CreateRole(t, e.db.Pool, role, "LOGIN")
	pcfg, err := pgxpool.ParseConfig(testsvc.PostgresDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	pcfg.ConnConfig.User = role
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	c, err := New(pool, e.nats.JS, recordEffect, e.config(&Config{}))
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Setup(ctx)
	if !errors.Is(err, ErrDedupTable) || !strings.Contains(err.Error(), "relay migrate grants --role consumer") {
		t.Fatalf("Setup as a role without USAGE on the schema: %v, want ErrDedupTable naming the grants command", err)
	}
	if _, err := e.nats.JS.Consumer(ctx, testStream, testDurable); err == nil {
		t.Fatal("the durable was created before the refusal")
	}
}

// stallingBeginner's Begin waits until its ctx ends, stalls times, then begins on db.
type stallingBeginner struct {
	db     *pgxpool.Pool
	stalls atomic.Int32
}

func (s *stallingBeginner) Begin(ctx context.Context) (pgx.Tx, error) {
	if s.stalls.Add(-1) >= 0 {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return s.db.Begin(ctx)
}

// A database that does not answer the table check within a Setup pass is waited for, and the
// warning says PostgreSQL, not JetStream: the pass's own deadline ended the check.
func TestTableCheckWaitsForPostgreSQLAndSaysSo(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var logs testsvc.LogBuffer
	db := &stallingBeginner{db: e.db.Pool}
	db.stalls.Store(1)
	c, err := New(db, e.nats.JS, recordEffect, e.config(&Config{Logger: logs.Logger()}))
	if err != nil {
		t.Fatal(err)
	}
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}}, "x")
	e.run(c)
	e.waitEffects(1)
	out := logs.String()
	if !strings.Contains(out, "waiting for PostgreSQL to answer the check of the consumer's tables") ||
		strings.Contains(out, "waiting for JetStream to set the consumer up") {
		t.Fatalf("logged:\n%s\nwant the wait blamed on PostgreSQL", out)
	}
}

// A dedup insert PostgreSQL refuses for want of a privilege (42501: a grant taken back, a
// row-level security policy) puts the message back, uncounted, with one warning that names
// the cause and the grants command (it said "the database or the broker failed"); once the
// refusal ends, the message is applied.
func TestRefusedDedupInsertSaysWhatToGrant(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var logs testsvc.LogBuffer
	c, err := New(e.db.Pool, e.nats.JS, recordEffect, e.config(&Config{Logger: logs.Logger()}))
	if err != nil {
		t.Fatal(err)
	}
	e.exec(`CREATE FUNCTION deny_dedup() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'permission denied for table txoutbox_consumer_dedup' USING ERRCODE = '42501'; END $$`)
	e.exec(`CREATE TRIGGER deny_dedup BEFORE INSERT ON txoutbox_consumer_dedup FOR EACH ROW EXECUTE FUNCTION deny_dedup()`)
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}}, "x")
	e.run(c)
	const warning = "PostgreSQL refuses the consumer's role (a missing privilege, or a row-level security policy)"
	testsvc.Eventually(t, 20*time.Second, "the refusal to be logged", func() bool { return strings.Contains(logs.String(), warning) })
	if !strings.Contains(logs.String(), "relay migrate grants --role consumer") {
		t.Errorf("the warning does not name the grants command:\n%s", logs.String())
	}
	e.exec(`DROP TRIGGER deny_dedup ON txoutbox_consumer_dedup`)
	e.waitEffects(1)
	if n := strings.Count(logs.String(), warning); n != 1 {
		t.Errorf("%d warnings, want 1 (one per state change):\n%s", n, logs.String())
	}
	if st := c.Stats(); st.DeadLettered != 0 {
		t.Errorf("Stats = %+v: the refused message was dead-lettered", st)
	}
}
