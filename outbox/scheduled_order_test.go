package outbox_test

import (
	"context"
	"database/sql"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

// A delivery time already past is not "publish now, in call order": the message is stored
// scheduled and takes its place in its key's order when the relay promotes it, so it is
// published after the ready messages of its key enqueued later in the same transaction, and
// two past-dated messages of one key go out in the order of their delivery times, not of the
// call. Through EnqueueTx and EnqueueSQLTx, published by a running relay.
func TestPastDeliverAtTakesItsKeyPlaceWhenPromoted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	nc := testsvc.NewNATS(t)
	nc.Stream(t, "PASTDUE", "pastdue.>")
	c := newClient(t, db, nil)
	batch := func(prefix string) []outbox.Message {
		m := func(key, name string, at time.Time) outbox.Message {
			return outbox.Message{Subject: "pastdue.event", Key: prefix + key, Payload: []byte(name), DeliverAt: at}
		}
		hourAgo, twoHoursAgo := time.Now().Add(-time.Hour), time.Now().Add(-2*time.Hour)
		return []outbox.Message{
			m("k", "A", hourAgo), m("k", "B", time.Time{}), m("k", "C", time.Time{}),
			m("k2", "P2", hourAgo), m("k2", "P1", twoHoursAgo), m("k2", "R", time.Time{}),
		}
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := c.EnqueueTx(ctx, tx, batch("pgx-")...)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	sdb := openSQL(t, db, "pgx")
	if err := inSQLTx(t, sdb, func(tx *sql.Tx) error {
		_, err := c.EnqueueSQLTx(ctx, tx, batch("sql-")...)
		return err
	}); err != nil {
		t.Fatal(err)
	}

	r, err := relay.New(db.Pool, nc.JS, &relay.Config{Schema: db.Schema, PollMax: 50 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	defer func() {
		cancel()
		<-done
	}()
	testsvc.Eventually(t, 20*time.Second, "the relay to publish every message", func() bool {
		return count(t, db, "true") == 0
	})
	byKey := map[string][]string{}
	for _, m := range testsvc.StreamMsgs(t, nc.JS, "PASTDUE") {
		k := m.Header.Get(outbox.HeaderKey)
		byKey[k] = append(byKey[k], string(m.Data))
	}
	for _, p := range []string{"pgx-", "sql-"} {
		if got := strings.Join(byKey[p+"k"], ","); got != "B,C,A" {
			t.Errorf("key %sk published %s, want B,C,A (A, past-dated, after the ready B and C of the same transaction)", p, got)
		}
		if got := strings.Join(byKey[p+"k2"], ","); got != "R,P1,P2" {
			t.Errorf("key %sk2 published %s, want R,P1,P2 (the past-dated ones after R, in the order of their delivery times)", p, got)
		}
	}
}
