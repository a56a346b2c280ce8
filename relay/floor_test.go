package relay

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// floorRelay is a relay whose claim floor is checked after every claim and never rescanned
// from the start, so that the tests exercise the floor alone.
func (e *env) floorRelay() *Relay {
	r := e.relay(nil)
	r.floor.checkEvery = 0
	r.floor.rescanEvery = 24 * time.Hour
	return r
}

// settleFloor runs a few claims with nothing to claim, so that the floor's checkpoints pass
// and it rises as far as it can.
func settleFloor(t *testing.T, r *Relay) {
	t.Helper()
	for range 3 {
		if _, err := r.runOnce(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

func (e *env) maxID() int64 {
	e.t.Helper()
	var id int64
	if err := e.db.Pool.QueryRow(context.Background(), "SELECT coalesce(max(id), 0) FROM txoutbox_messages").Scan(&id); err != nil {
		e.t.Fatal(err)
	}
	return id
}

func floorPayloads(e *env) string {
	var got []string
	for _, m := range e.streamMsgs("ORDERS") {
		got = append(got, string(m.Data))
	}
	return strings.Join(got, ",")
}

// An id drawn before a higher one was claimed, whose transaction commits later, is still
// claimed: the floor does not rise past a transaction that holds a write lock on the table.
// Once it has committed and everything is published, the floor rises to the last id.
func TestClaimFloorWaitsForOpenWriters(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	r := e.floorRelay()

	late, err := e.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)
	if _, err := e.client.EnqueueTx(ctx, late, outbox.Message{Subject: "orders.late", Payload: []byte("late")}); err != nil {
		t.Fatal(err)
	}
	var lateID int64
	if err := late.QueryRow(ctx, "SELECT max(id) FROM txoutbox_messages").Scan(&lateID); err != nil {
		t.Fatal(err)
	}
	e.enqueue(outbox.Message{Subject: "orders.a", Payload: []byte("a")}, outbox.Message{Subject: "orders.b", Payload: []byte("b")})
	drain(t, r)
	settleFloor(t, r)
	if got := floorPayloads(e); got != "a,b" {
		t.Fatalf("stream %q, want a,b", got)
	}
	if f := r.floor.Floor(); f >= lateID {
		t.Fatalf("floor %d rose to or past id %d of a transaction still open", f, lateID)
	}

	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	drain(t, r)
	if got := floorPayloads(e); got != "a,b,late" {
		t.Fatalf("stream %q, want a,b,late: the late commit below the claimed ids was lost", got)
	}
	settleFloor(t, r)
	if f, top := r.floor.Floor(), e.maxID(); f == 0 || f < lateID {
		t.Fatalf("floor %d after everything up to id %d (late %d) was published: it should have risen", f, top, lateID)
	}

	// Rows above the floor still go out; the floor follows them.
	before := r.floor.Floor()
	e.enqueue(outbox.Message{Subject: "orders.c", Payload: []byte("c")})
	drain(t, r)
	settleFloor(t, r)
	if got := floorPayloads(e); got != "a,b,late,c" {
		t.Fatalf("stream %q, want a,b,late,c", got)
	}
	if f := r.floor.Floor(); f <= before {
		t.Fatalf("floor %d did not rise past %d", f, before)
	}
}

// A dead row pins the floor below it, so that when an operator requeues it (it keeps its id)
// it goes out before the later messages of its key, which it held back, and before new ones.
func TestClaimFloorStaysBelowDeadRows(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	r := e.floorRelay()
	e.enqueue(outbox.Message{Subject: "orders.x", Key: "k", Payload: []byte("k1")}, outbox.Message{Subject: "orders.x", Key: "k", Payload: []byte("k2")})
	// k1 died (as after MaxAttempts failed publishes): it holds k2 back.
	if _, err := e.db.Pool.Exec(ctx, "UPDATE txoutbox_messages SET state = 'dead', attempts = 1, last_error = 'test' WHERE payload = 'k1'"); err != nil {
		t.Fatal(err)
	}
	var deadID int64
	if err := e.db.Pool.QueryRow(ctx, "SELECT id FROM txoutbox_messages WHERE payload = 'k1'").Scan(&deadID); err != nil {
		t.Fatal(err)
	}
	// Unkeyed traffic moves the floor as far as it may.
	for i := range 3 {
		e.enqueue(outbox.Message{Subject: "orders.u", Payload: []byte{'u', byte('0' + i)}})
		drain(t, r)
		settleFloor(t, r)
	}
	if got := floorPayloads(e); got != "u0,u1,u2" {
		t.Fatalf("stream %q, want the unkeyed messages only", got)
	}
	if f := r.floor.Floor(); f >= deadID {
		t.Fatalf("floor %d at or above the dead row %d", f, deadID)
	}

	ids, err := r.q.RequeueDead(ctx, e.db.Pool, store.DeadFilter{Subject: "orders.x"})
	if err != nil || len(ids) != 1 {
		t.Fatalf("requeue: %v %v", ids, err)
	}
	e.enqueue(outbox.Message{Subject: "orders.x", Key: "k", Payload: []byte("k3")})
	drain(t, r)
	if got := floorPayloads(e); got != "u0,u1,u2,k1,k2,k3" {
		t.Fatalf("stream %q, want k1,k2,k3 in order after the unkeyed ones", got)
	}
}

// ClaimFloor names the sessions writing to the table, and not the readers.
func TestClaimFloorReadsWriters(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	q := store.New(e.db.Schema)
	writer, err := e.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Rollback(ctx)
	if _, err := e.client.EnqueueTx(ctx, writer, outbox.Message{ID: uuid.New(), Subject: "orders.w", Payload: []byte("w")}); err != nil {
		t.Fatal(err)
	}
	var vxid string
	if err := writer.QueryRow(ctx, "SELECT virtualtransaction FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'virtualxid'").Scan(&vxid); err != nil {
		t.Fatal(err)
	}
	reader, err := e.db.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback(ctx)
	var rvxid string
	if err := reader.QueryRow(ctx, "SELECT virtualtransaction FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'virtualxid' AND (SELECT count(*) FROM txoutbox_messages) >= 0").Scan(&rvxid); err != nil {
		t.Fatal(err)
	}
	st, err := q.ClaimFloor(ctx, e.db.Pool, store.FloorArgs{PartitionCount: 8})
	if err != nil {
		t.Fatal(err)
	}
	if !contains(st.Writers, vxid) || contains(st.Writers, rvxid) || st.Prepared {
		t.Fatalf("writers %v (prepared %v), want the writer %s and not the reader %s", st.Writers, st.Prepared, vxid, rvxid)
	}
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// The safety net: a ready row below the floor (which the floor's rules should never let
// happen; here one is written there by hand) is found by the background look below the floor
// and published.
func TestClaimFloorProbeFindsRowsBelow(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	r := e.floorRelay()
	for i := range 3 {
		e.enqueue(outbox.Message{Subject: "orders.u", Payload: []byte{'u', byte('0' + i)}})
	}
	drain(t, r)
	settleFloor(t, r)
	floor := r.floor.Floor()
	if floor < 2 {
		t.Fatalf("floor %d, want it risen past the published rows", floor)
	}
	// A row with an id below the floor, ready.
	if _, err := e.db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (id, message_id, subject, partition_key, payload)
		OVERRIDING SYSTEM VALUE VALUES (1, $1, 'orders.below', 0, 'below')`, uuid.New()); err != nil {
		t.Fatal(err)
	}
	drain(t, r)
	if got := floorPayloads(e); got != "u0,u1,u2" {
		t.Fatalf("stream %q: the row below the floor went out before the probe", got)
	}
	r.floor.mu.Lock()
	r.floor.rescanEvery = 0
	r.floor.mu.Unlock()
	testsvc.Eventually(t, 10*time.Second, "the row below the floor to be published", func() bool {
		if _, err := r.runOnce(ctx); err != nil {
			t.Fatal(err)
		}
		return floorPayloads(e) == "u0,u1,u2,below"
	})
}
