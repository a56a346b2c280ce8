package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// promoteNow makes the relay's next claim promote, whatever its last promotion was.
func promoteNow(r *Relay) { r.sched = scheduler{} }

// backdate makes the given scheduled messages due (a back-dated fixture instead of waiting).
func (e *env) backdate(ids ...uuid.UUID) {
	e.t.Helper()
	if _, err := e.db.Pool.Exec(context.Background(),
		`UPDATE txoutbox_messages SET deliver_at = now() - interval '1 second' WHERE message_id = ANY($1) AND state = 'scheduled'`, ids); err != nil {
		e.t.Fatal(err)
	}
}

// published returns the message ids in the stream, in stream order.
func (e *env) published(stream string) []string {
	var out []string
	for _, m := range e.streamMsgs(stream) {
		out = append(out, m.Header.Get("Nats-Msg-Id"))
	}
	return out
}

func TestScheduledPublishedWhenDue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	reg := prometheus.NewRegistry()
	r := e.relay(&Config{Registerer: reg})
	ids := e.enqueue(outbox.Message{Subject: "orders.timeout", Key: "o1", Payload: []byte("t"), DeliverAt: time.Now().Add(time.Hour)})
	drain(t, r)
	if got := e.published("ORDERS"); len(got) != 0 {
		t.Fatalf("published %v before the delivery time", got)
	}
	if n := e.count("state = 'scheduled'"); n != 1 {
		t.Fatalf("%d scheduled rows, want 1", n)
	}
	// The relay knows when to wake.
	if until := time.Until(r.sched.next); until < 50*time.Minute || until > 61*time.Minute {
		t.Fatalf("next due in %v, want about an hour", until)
	}
	e.backdate(ids...)
	promoteNow(r)
	drain(t, r)
	if got := e.published("ORDERS"); len(got) != 1 || got[0] != ids[0].String() {
		t.Fatalf("published %v, want [%v]", got, ids[0])
	}
	if n := e.count("true"); n != 0 {
		t.Fatalf("%d rows left, want none", n)
	}
	if n := testutil.ToFloat64(r.sm.promoted); n != 1 {
		t.Fatalf("promoted counter %v, want 1", n)
	}
	if n := testutil.CollectAndCount(r.sm.lateness); n != 1 {
		t.Fatalf("lateness histogram has %d series, want 1", n)
	}
	var lateCount uint64
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "txoutbox_relay_scheduled_lateness_seconds" {
			lateCount = mf.GetMetric()[0].GetHistogram().GetSampleCount()
		}
	}
	if lateCount != 1 {
		t.Fatalf("lateness observations %d, want 1", lateCount)
	}
}

// A running relay publishes a delayed message at its time, never before: the stream's
// timestamp of the message is not earlier than its delivery time.
func TestScheduledNeverEarly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(&Config{DisableDoorbell: true})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	var ids []uuid.UUID
	var dues []time.Time
	for i := range 5 {
		due := time.Now().Add(time.Duration(200+100*i) * time.Millisecond)
		dues = append(dues, due)
		ids = append(ids, e.enqueue(outbox.Message{Subject: "orders.timeout", Payload: []byte{byte(i)}, DeliverAt: due})...)
	}
	testsvc.Eventually(t, 30*time.Second, "every delayed message in the stream", func() bool {
		return len(e.streamMsgs("ORDERS")) == len(ids)
	})
	byID := map[string]time.Time{}
	for i, id := range ids {
		byID[id.String()] = dues[i]
	}
	for _, m := range e.streamMsgs("ORDERS") {
		due := byID[m.Header.Get("Nats-Msg-Id")]
		if m.Time.Before(due.Truncate(time.Microsecond)) {
			t.Errorf("message %s stored at %v, before its delivery time %v", m.Header.Get("Nats-Msg-Id"), m.Time, due)
		}
	}
}

// A delayed keyed message holds nothing back while it waits, and takes its place in its
// key's order when it falls due: after the messages of the key that became ready before it,
// before those that become ready after it.
func TestScheduledKeyOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(nil)
	msg := func(name string, due time.Time) outbox.Message {
		return outbox.Message{Subject: "orders.event", Key: "order-1", Payload: []byte(name), DeliverAt: due}
	}
	a := e.enqueue(msg("A", time.Now().Add(time.Hour)))
	e.enqueue(msg("B", time.Time{}), msg("C", time.Time{}))
	drain(t, r)
	e.enqueue(msg("D", time.Time{}))
	e.backdate(a...)
	promoteNow(r)
	drain(t, r)
	e.enqueue(msg("E", time.Time{}))
	drain(t, r)
	var got string
	for _, m := range e.streamMsgs("ORDERS") {
		got += string(m.Data)
	}
	if got != "BCDAE" {
		t.Fatalf("stream order %q, want BCDAE (B, C not held back by the waiting A; A after D, ready before it fell due; E after A)", got)
	}
}

// A failed publish of a delayed message that fell due holds back the later messages of its
// key, like any message's.
func TestScheduledFailureHoldsBackItsKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(nil)
	a := e.enqueue(outbox.Message{Subject: "nowhere.timeout", Key: "k", Payload: []byte("A"), DeliverAt: time.Now().Add(time.Hour)})
	e.backdate(a...)
	promoteNow(r)
	// A publish without a stream counts as a failed attempt once the relay has told "no
	// stream" from an outage.
	testsvc.Eventually(t, 20*time.Second, "the promoted message without a stream to fail", func() bool {
		if _, err := r.runOnce(context.Background()); err != nil && !errors.Is(err, errBrokerUnavailable) {
			t.Fatal(err)
		}
		return e.count("state IN ('ready', 'dead') AND attempts > 0 AND message_id = $1", a[0]) == 1
	})
	e.enqueue(outbox.Message{Subject: "orders.event", Key: "k", Payload: []byte("B")})
	drain(t, r)
	if got := e.streamMsgs("ORDERS"); len(got) != 0 {
		t.Fatalf("B published while the failed delayed message of its key waits for its retry")
	}
}

// A cancel that holds the row (its transaction still open) makes the relay skip the row; if
// it commits, the message is never published; if it rolls back, the message goes out.
func TestCancelInFlightIsSkipped(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	r := e.relay(nil)
	ids := e.enqueue(
		outbox.Message{Subject: "orders.timeout", Payload: []byte("1"), DeliverAt: time.Now().Add(time.Hour)},
		outbox.Message{Subject: "orders.timeout", Payload: []byte("2"), DeliverAt: time.Now().Add(time.Hour)},
	)
	for i, commit := range []bool{true, false} {
		e.backdate(ids[i])
		tx, err := e.db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) }) // never left open by a failure
		if err := e.client.CancelTx(ctx, tx, ids[i]); err != nil {
			t.Fatal(err)
		}
		promoteNow(r)
		drain(t, r)
		if n := e.count("state = 'scheduled' AND message_id = $1", ids[i]); n != 1 {
			t.Fatalf("the relay took a due row whose cancel is in progress")
		}
		if commit {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		promoteNow(r)
		drain(t, r)
	}
	got := e.published("ORDERS")
	if len(got) != 1 || got[0] != ids[1].String() {
		t.Fatalf("published %v, want only the message whose cancel rolled back (%v)", got, ids[1])
	}
	if n := e.count("state <> 'rolled_back'"); n != 0 {
		t.Fatalf("%d rows left besides the cancelled one", n)
	}
}

// A cancel after the relay took the row (claimed, published, not yet settled) is told so.
func TestCancelAfterClaimRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	r := e.relay(nil)
	ids := e.enqueue(outbox.Message{Subject: "orders.timeout", DeliverAt: time.Now().Add(time.Hour)})
	e.backdate(ids...)
	var cancelErr error
	r.hooks.afterPublish = func(context.Context, int) error {
		cancelErr = pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error { return e.client.CancelTx(ctx, tx, ids[0]) })
		return nil
	}
	promoteNow(r)
	if n, err := r.runOnce(ctx); n != 1 || err != nil {
		t.Fatalf("runOnce = %d, %v", n, err)
	}
	var se *outbox.ScheduleError
	if !errors.Is(cancelErr, outbox.ErrNotScheduled) || !errors.As(cancelErr, &se) || se.State != store.StateReady {
		t.Fatalf("cancel while the relay publishes = %v; want ErrNotScheduled, state ready", cancelErr)
	}
	if got := e.published("ORDERS"); len(got) != 1 {
		t.Fatalf("published %v, want the message once", got)
	}
}

// Cancels race two relays publishing the same rows: every message is either cancelled (the
// cancel committed) and never published, or refused (ErrNotScheduled) and published once,
// never both, never neither.
func TestCancelRacesRelay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	const n = 300
	// Due one after another, 5ms apart, from a second from now; each cancel is paced to its
	// message's due time, so that cancels meet rows just before, while and just after the
	// relays take them.
	base := time.Now().Add(time.Second)
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = outbox.Message{Subject: "orders.timeout", Key: fmt.Sprintf("k%d", i%7), Payload: []byte(fmt.Sprint(i)),
			DeliverAt: base.Add(time.Duration(i) * 5 * time.Millisecond)}
	}
	ids := e.enqueue(msgs...)

	rctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i := range 2 { // two relays: concurrent promotions too
		r := e.relay(&Config{ID: fmt.Sprint(i), BatchSize: 7})
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := r.Run(rctx); err != nil {
				t.Errorf("Run: %v", err)
			}
		}()
	}
	t.Cleanup(func() { stop(); wg.Wait() }) // before the relays close
	var mu sync.Mutex
	cancelled := map[string]bool{}
	var refused int
	var cwg sync.WaitGroup
	for w := range 2 { // two cancellers, each every other message, in due order
		cwg.Add(1)
		go func() {
			defer cwg.Done()
			for i := w; i < n; i += 2 {
				id := ids[i]
				time.Sleep(time.Until(msgs[i].DeliverAt)) // pacing: cancel when the message falls due
				err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error { return e.client.CancelTx(ctx, tx, id) })
				mu.Lock()
				switch {
				case err == nil:
					cancelled[id.String()] = true
				case errors.Is(err, outbox.ErrNotScheduled):
					refused++ // promoted: being published (ready), or published and deleted (not found)
				default:
					t.Errorf("cancel %d: %v", i, err)
				}
				mu.Unlock()
			}
		}()
	}
	cwg.Wait()
	testsvc.Eventually(t, 60*time.Second, "every row settled", func() bool { return e.count("state <> 'rolled_back'") == 0 })
	stop()
	wg.Wait()
	got := e.published("ORDERS")
	seen := map[string]bool{}
	for _, id := range got {
		if seen[id] {
			t.Errorf("message %s published twice", id)
		}
		seen[id] = true
		if cancelled[id] {
			t.Errorf("message %s published although its cancel committed", id)
		}
	}
	if c := e.count("state = 'rolled_back' AND settled_by = 'cancel'"); c != len(cancelled) {
		t.Errorf("%d rows cancelled in the table, %d cancels committed", c, len(cancelled))
	}
	if len(got)+len(cancelled) != n {
		t.Fatalf("%d published + %d cancelled != %d messages (%d cancels refused)", len(got), len(cancelled), n, refused)
	}
	t.Logf("%d cancelled, %d refused (too late), %d published", len(cancelled), refused, len(got))
}

// A large scheduled backlog far ahead costs the claim and the promotion nothing: neither
// reads one of its rows.
func TestFarFutureBacklogNotRead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	const far = 20000
	if _, err := e.db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, deliver_at)
SELECT gen_random_uuid(), 'orders.far', g, '\x00', 'scheduled', now() + interval '1 day' + g * interval '1 second'
FROM generate_series(1, $1) g`, far); err != nil {
		t.Fatal(err)
	}
	due := e.enqueue(
		outbox.Message{Subject: "orders.timeout", Key: "k", DeliverAt: time.Now().Add(time.Hour)},
		outbox.Message{Subject: "orders.timeout", DeliverAt: time.Now().Add(time.Hour)},
		outbox.Message{Subject: "orders.timeout", DeliverAt: time.Now().Add(time.Hour)},
	)
	e.backdate(due...)
	e.enqueue(outbox.Message{Subject: "orders.created"})
	if _, err := e.db.Pool.Exec(ctx, `ANALYZE txoutbox_messages`); err != nil {
		t.Fatal(err)
	}
	q := store.New(e.db.Schema)
	// The rows each index scan of the statement read, by index.
	scanned := func(sql string, args ...any) map[string]float64 {
		t.Helper()
		var plan []byte
		err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, `EXPLAIN (ANALYZE, FORMAT JSON) `+sql, args...).Scan(&plan)
		}) // EXPLAIN ANALYZE runs the statement: in a transaction (committed; promotion is what we want)
		if err != nil {
			t.Fatal(err)
		}
		var doc []struct{ Plan map[string]any }
		if err := json.Unmarshal(plan, &doc); err != nil {
			t.Fatal(err)
		}
		out := map[string]float64{}
		var walk func(n map[string]any)
		walk = func(n map[string]any) {
			if idx, ok := n["Index Name"].(string); ok {
				loops, _ := n["Actual Loops"].(float64)
				rows, _ := n["Actual Rows"].(float64)
				removed, _ := n["Rows Removed by Filter"].(float64)
				out[idx] += (rows + removed) * max(loops, 1)
			}
			if n["Node Type"] == "Seq Scan" {
				out["seq scan of "+fmt.Sprint(n["Relation Name"])] += 1
			}
			if kids, ok := n["Plans"].([]any); ok {
				for _, k := range kids {
					walk(k.(map[string]any))
				}
			}
		}
		walk(doc[0].Plan)
		return out
	}
	promote := scanned(q.PromoteSQL(), int32(store.PromoteLimit))
	if got := promote["txoutbox_messages_scheduled_idx"]; got == 0 || got > 10 {
		t.Fatalf("promotion read %v rows of the scheduled index, want the 3 due ones and the next one (plan scans: %v)", got, promote)
	}
	for k, v := range promote {
		switch {
		case k == "txoutbox_messages_scheduled_key_idx" && v > 10:
			// The key-order probe looks only at earlier scheduled rows of a due row's key.
			t.Fatalf("promotion read %v rows of the scheduled key index (%v)", v, promote)
		case k != "txoutbox_messages_scheduled_idx" && k != "txoutbox_messages_pkey" && k != "txoutbox_messages_scheduled_key_idx":
			t.Fatalf("promotion scanned %s (%v)", k, promote)
		}
	}
	if n := e.count("state = 'ready'"); n != 4 {
		t.Fatalf("%d ready rows after the promotion, want 4", n)
	}
	claim := scanned(q.ClaimSQL(), 100, nil, int32(8), []int64{}, int64(0), []string{})
	for k, v := range claim {
		if v > 10 {
			t.Fatalf("the claim read %v rows through %s, want at most the 4 ready ones (plan scans: %v)", v, k, claim)
		}
	}
	if n := e.count("state = 'scheduled'"); n != far {
		t.Fatalf("%d scheduled rows, want %d", n, far)
	}
}

// Two delayed messages of one key that fall due in the same pass go out in due order, not
// enqueue order.
func TestScheduledSameKeyDueOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(nil)
	now := time.Now()
	var msgs []outbox.Message
	for i, name := range []string{"E", "D", "C", "B", "A"} { // enqueued E first, due last
		msgs = append(msgs, outbox.Message{Subject: "orders.event", Key: "k", Payload: []byte(name), DeliverAt: now.Add(time.Hour - time.Duration(i)*time.Minute)})
	}
	ids := e.enqueue(msgs...)
	if _, err := e.db.Pool.Exec(context.Background(), `UPDATE txoutbox_messages SET deliver_at = deliver_at - interval '2 hours' WHERE message_id = ANY($1)`, ids); err != nil {
		t.Fatal(err)
	}
	promoteNow(r)
	drain(t, r)
	var got string
	for _, m := range e.streamMsgs("ORDERS") {
		got += string(m.Data)
	}
	if got != "ABCDE" {
		t.Fatalf("stream order %q, want ABCDE (due order)", got)
	}
}

// A key's delayed messages are published in due order even while the earliest one's row is
// locked when the relay promotes (a cancel in progress that then rolls back): the later one
// waits for it instead of overtaking it.
func TestPromotionWaitsForALockedEarlierRowOfItsKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	r := e.relay(nil)
	ids := e.enqueue(
		outbox.Message{Subject: "orders.event", Key: "k", Payload: []byte("first"), DeliverAt: time.Now().Add(time.Hour)},
		outbox.Message{Subject: "orders.event", Key: "k", Payload: []byte("second"), DeliverAt: time.Now().Add(2 * time.Hour)},
	)
	if _, err := e.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET deliver_at = deliver_at - interval '3 hours' WHERE message_id = ANY($1)`, ids); err != nil {
		t.Fatal(err)
	}
	tx, err := e.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A failing test must not leave the cancel open: the schema's cleanup would wait on it.
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if err := e.client.CancelTx(ctx, tx, ids[0]); err != nil {
		t.Fatal(err)
	}
	promoteNow(r)
	drain(t, r)
	if got := e.published("ORDERS"); len(got) != 0 {
		t.Fatalf("published %v while the key's earlier row was locked by a cancel in progress", got)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	promoteNow(r)
	drain(t, r)
	var got string
	for _, m := range e.streamMsgs("ORDERS") {
		got += string(m.Data) + " "
	}
	if got != "first second " {
		t.Fatalf("stream order %q, want first second (due order)", got)
	}
}

// A key held while more of its rows are due than a promotion looks at (PromoteLimit) takes
// one place of the promotion, not all of them: the other keys' due rows and the unkeyed ones
// are promoted and published in the same pass, the held key is not followed (no statement a
// round spent on a key that cannot move), and once released its rows go out in due order.
// Held by a producer's open transaction (EnqueueTx takes the key lock) or by an uncommitted
// CancelTx of its earliest row (the row lock).
func TestHeldKeyDoesNotStallOtherScheduledRows(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		hold func(e *env, tx pgx.Tx, first uuid.UUID) error
	}{
		{"producer transaction holds the key", func(e *env, tx pgx.Tx, _ uuid.UUID) error {
			_, err := e.client.EnqueueTx(context.Background(), tx, outbox.Message{Subject: "orders.event", Key: "hot", Payload: []byte("live")})
			return err
		}},
		{"uncommitted cancel holds its earliest row", func(e *env, tx pgx.Tx, first uuid.UUID) error {
			return e.client.CancelTx(context.Background(), tx, first)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			e := newEnv(t)
			r := e.relay(nil)
			hot := store.PromoteLimit + 44
			base := time.Now().Add(time.Hour)
			var msgs []outbox.Message
			for i := range hot {
				msgs = append(msgs, outbox.Message{Subject: "orders.event", Key: "hot", Payload: []byte(fmt.Sprintf("hot/%d", i)), DeliverAt: base.Add(time.Duration(i) * time.Millisecond)})
			}
			// Due after every row of the held key.
			msgs = append(msgs,
				outbox.Message{Subject: "orders.event", Key: "other", Payload: []byte("other"), DeliverAt: base.Add(time.Second)},
				outbox.Message{Subject: "orders.event", Payload: []byte("unkeyed"), DeliverAt: base.Add(time.Second)})
			ids := e.enqueue(msgs...)
			if _, err := e.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET deliver_at = deliver_at - interval '2 hours' WHERE state = 'scheduled'`); err != nil {
				t.Fatal(err)
			}
			tx, err := e.db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			// A failing test must not leave the transaction open: the schema's cleanup would wait on it.
			t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
			if err := tc.hold(e, tx, ids[0]); err != nil {
				t.Fatal(err)
			}
			promoteNow(r)
			if _, err := r.runOnce(ctx); err != nil {
				t.Fatal(err)
			}
			if n := e.count("state = 'scheduled' AND (msg_key IS NULL OR msg_key = 'other')"); n != 0 {
				t.Fatalf("%d due rows of other keys still scheduled after a pass while key hot is held", n)
			}
			if got := e.published("ORDERS"); len(got) != 2 {
				t.Fatalf("published %d messages in the pass, want the 2 of the other keys", len(got))
			}
			if n := e.count("state = 'scheduled' AND msg_key = 'hot'"); n != hot {
				t.Fatalf("%d rows of the held key left scheduled, want %d", n, hot)
			}
			if len(r.sched.follow.Keys) != 0 {
				t.Fatalf("the next pass follows %v (%d rounds): keys that did not move", r.sched.follow.Keys, r.sched.follow.Rounds)
			}
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			promoteNow(r)
			drain(t, r)
			var seqs []int
			for _, m := range e.streamMsgs("ORDERS") {
				var seq int
				if _, err := fmt.Sscanf(string(m.Data), "hot/%d", &seq); err == nil {
					seqs = append(seqs, seq)
				}
			}
			if len(seqs) != hot {
				t.Fatalf("%d rows of key hot published after it was released, want %d", len(seqs), hot)
			}
			for i, s := range seqs {
				if s != i {
					t.Fatalf("key hot went out in the order %v, want its due order", seqs)
				}
			}
		})
	}
}

// A delivery time past the range of a time.Duration (about 292 years ahead) does not wrap
// around: the relay knows the row is not due, stays idle (no promotion until its poll
// interval is out, however often it claims), does not shorten its idle wait, and the gauge of
// the next due time is the (large, positive) number of seconds until it. Up to MaxDeliverAt.
func TestScheduledFarBeyondDurationRange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	// A poll interval longer than the test: every promotion after the first is one the relay
	// thought due.
	r := e.relay(&Config{PollMin: time.Hour, PollMax: time.Hour})
	ids := e.enqueue(outbox.Message{Subject: "orders.timeout", Payload: []byte("far"), DeliverAt: time.Now().Add(time.Hour)})
	for _, due := range []time.Time{time.Date(2400, 1, 1, 0, 0, 0, 0, time.UTC), outbox.MaxDeliverAt} {
		if _, err := e.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET deliver_at = $2 WHERE message_id = $1`, ids[0], due); err != nil {
			t.Fatal(err)
		}
		promoteNow(r)
		for range 20 {
			if n, err := r.runOnce(ctx); n != 0 || err != nil {
				t.Fatalf("due %v: runOnce = %d, %v; want nothing to publish", due, n, err)
			}
		}
		if r.sched.rounds != 1 {
			t.Errorf("due %v: %d promotions in 20 claims, want 1: the relay thinks the row is due (next %v)", due, r.sched.rounds, r.sched.next)
		}
		if r.sched.next.Before(time.Now().AddDate(250, 0, 0)) {
			t.Errorf("due %v: the relay expects the next row at %v", due, r.sched.next)
		}
		if w := r.capWait(time.Hour); w != time.Hour {
			t.Errorf("due %v: idle wait cut to %v, want the poll interval (1h)", due, w)
		}
		if err := r.sampleScheduled(ctx); err != nil {
			t.Fatal(err)
		}
		want := float64(due.Unix() - time.Now().Unix())
		if got := testutil.ToFloat64(r.sm.nextDue); got < want-60 || got > want+60 {
			t.Errorf("due %v: next_scheduled_seconds = %g, want about %g", due, got, want)
		}
	}
	if got := e.published("ORDERS"); len(got) != 0 {
		t.Fatalf("published %v", got)
	}
}

// The next-due gauge goes negative when the earliest scheduled row is overdue (no relay
// promoted it), as its help and the README say, and is 0 when there is none. Overdue counts
// from the due time, as lateness does: a row committed just now with a delivery time two
// minutes past (the caller's choice) is due now, not two minutes overdue.
func TestNextScheduledGaugeNegativeWhenOverdue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	r := e.relay(nil)
	if err := r.sampleScheduled(ctx); err != nil || testutil.ToFloat64(r.sm.nextDue) != 0 {
		t.Fatalf("gauge without scheduled rows = %v (%v), want 0", testutil.ToFloat64(r.sm.nextDue), err)
	}
	ids := e.enqueue(outbox.Message{Subject: "orders.timeout", DeliverAt: time.Now().Add(-2 * time.Minute)},
		outbox.Message{Subject: "orders.timeout", DeliverAt: time.Now().Add(time.Hour)})
	if err := r.sampleScheduled(ctx); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(r.sm.nextDue); got > 0 || got < -30 {
		t.Fatalf("next_scheduled_seconds with a row committed just now, its delivery time two minutes past = %g, want about 0", got)
	}
	// The other row inserted and due an hour ago (a back-dated fixture: no relay ran since).
	if _, err := e.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET deliver_at = now() - interval '1 hour', created_at = now() - interval '2 hours'
WHERE message_id = $1`, ids[1]); err != nil {
		t.Fatal(err)
	}
	if err := r.sampleScheduled(ctx); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(r.sm.nextDue); got > -3590 || got < -3700 {
		t.Fatalf("next_scheduled_seconds with a row overdue by an hour = %g, want about -3600", got)
	}
}

// lateness returns the lateness histogram's count and sum.
func lateness(t *testing.T, r *Relay) (uint64, float64) {
	t.Helper()
	var m dto.Metric
	if err := r.sm.lateness.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
}

// Lateness counts from when a delayed message became due: the later of its delivery time and
// the time it could first have been published (its commit, a half message's commit, its last
// reschedule). A delivery time the caller chose in the past, a half message committed after
// its time, a reschedule into the past: no lateness of the relay's. A message that was due
// and committed an hour before a relay promoted it: an hour.
func TestLatenessFromWhenDue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	r := e.relay(nil)
	backdate := func(sql string, id uuid.UUID) {
		t.Helper()
		if _, err := e.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET `+sql+` WHERE message_id = $1`, id); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		name     string
		setup    func() // makes one message due
		min, max float64
	}{
		{"delivery time an hour before the enqueue", func() {
			e.enqueue(outbox.Message{Subject: "orders.timeout", DeliverAt: time.Now().Add(-time.Hour)})
		}, 0, 30},
		{"half message due an hour before its commit", func() {
			h, err := e.client.Prepare(ctx, e.db.Pool, outbox.Message{Subject: "orders.timeout", DeliverAt: time.Now().Add(time.Hour)}, &outbox.PrepareOptions{Fence: true})
			if err != nil {
				t.Fatal(err)
			}
			backdate(`created_at = created_at - interval '2 hours', deliver_at = now() - interval '1 hour'`, h.ID)
			if err := e.client.Commit(ctx, e.db.Pool, h.ID); err != nil {
				t.Fatal(err)
			}
		}, 0, 30},
		{"rescheduled into the past", func() {
			ids := e.enqueue(outbox.Message{Subject: "orders.timeout", Key: "k", DeliverAt: time.Now().Add(time.Hour)})
			backdate(`created_at = created_at - interval '2 hours'`, ids[0])
			if err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
				return e.client.RescheduleTx(ctx, tx, ids[0], time.Now().Add(-time.Hour))
			}); err != nil {
				t.Fatal(err)
			}
		}, 0, 30},
		{"business key rescheduled into the past", func() {
			ids := e.enqueue(outbox.Message{Subject: "orders.timeout", BizKey: "order:1:timeout", DeliverAt: time.Now().Add(time.Hour)})
			backdate(`created_at = created_at - interval '2 hours'`, ids[0])
			if err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
				_, err := e.client.RescheduleBizKeyTx(ctx, tx, "order:1:timeout", time.Now().Add(-time.Hour))
				return err
			}); err != nil {
				t.Fatal(err)
			}
		}, 0, 30},
		{"rescheduled into the past by the SQL function", func() {
			ids := e.enqueue(outbox.Message{Subject: "orders.timeout", DeliverAt: time.Now().Add(time.Hour)})
			backdate(`created_at = created_at - interval '2 hours'`, ids[0])
			if _, err := e.db.Pool.Exec(ctx, `SELECT txoutbox_reschedule($1, now() - interval '1 hour')`, ids[0]); err != nil {
				t.Fatal(err)
			}
		}, 0, 30},
		{"business key rescheduled into the past by the SQL function", func() {
			ids := e.enqueue(outbox.Message{Subject: "orders.timeout", BizKey: "order:2:timeout", DeliverAt: time.Now().Add(time.Hour)})
			backdate(`created_at = created_at - interval '2 hours'`, ids[0])
			if _, err := e.db.Pool.Exec(ctx, `SELECT txoutbox_reschedule_biz_key('order:2:timeout', now() - interval '1 hour')`); err != nil {
				t.Fatal(err)
			}
		}, 0, 30},
		{"due and committed an hour before promotion", func() {
			ids := e.enqueue(outbox.Message{Subject: "orders.timeout", DeliverAt: time.Now().Add(time.Hour)})
			backdate(`created_at = created_at - interval '2 hours', deliver_at = now() - interval '1 hour'`, ids[0])
		}, 3600, 3700},
	} {
		n0, sum0 := lateness(t, r)
		c.setup()
		promoteNow(r)
		drain(t, r)
		n, sum := lateness(t, r)
		if n != n0+1 {
			t.Fatalf("%s: %d lateness observations, want 1", c.name, n-n0)
		}
		if got := sum - sum0; got < c.min || got > c.max {
			t.Errorf("%s: lateness %.1fs, want %v..%vs", c.name, got, c.min, c.max)
		}
	}
	// An undelayed message records none.
	n0, _ := lateness(t, r)
	e.enqueue(outbox.Message{Subject: "orders.created"})
	drain(t, r)
	if n, _ := lateness(t, r); n != n0 {
		t.Fatalf("an undelayed message recorded lateness")
	}
}

// A burst of due rows of one key is promoted in a few passes, not one row per pass, and
// published in the key's due order; the other keys' due rows, due among and after them, go
// out in the same few passes, each key in due order, after the key's earlier ready rows.
func TestScheduledBurstOfOneKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	r := e.relay(&Config{BatchSize: 1000})
	const hot, others, perOther = 1500, 5, 10
	base := time.Now().Add(time.Hour)
	var msgs []outbox.Message
	add := func(key string, seq int, due time.Time) {
		msgs = append(msgs, outbox.Message{Subject: "orders.event", Key: key, Payload: []byte(fmt.Sprintf("%s/%d", key, seq)), DeliverAt: due})
	}
	for i := range hot {
		add("hot", i, base.Add(time.Duration(i)*time.Millisecond))
	}
	for k := range others {
		for i := range perOther { // due among the hot key's rows, and the last ones after all of them
			add(fmt.Sprintf("k%d", k), i, base.Add(time.Duration(i*200+k)*time.Millisecond))
		}
	}
	// Enqueued in an order unlike the due order: ids say nothing of it.
	for i := range msgs {
		j := (i * 7919) % len(msgs)
		msgs[i], msgs[j] = msgs[j], msgs[i]
	}
	// A ready row of k0 enqueued before: it goes out before k0's delayed ones.
	e.enqueue(outbox.Message{Subject: "orders.event", Key: "k0", Payload: []byte("k0/-1")})
	for i := 0; i < len(msgs); i += 500 {
		e.enqueue(msgs[i:min(i+500, len(msgs))]...)
	}
	if _, err := e.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET deliver_at = deliver_at - interval '2 hours' WHERE state = 'scheduled'`); err != nil {
		t.Fatal(err)
	}
	promoteNow(r)
	passes := 0
	for {
		n, err := r.runOnce(ctx)
		if err != nil {
			t.Fatal(err)
		}
		passes++
		if n == 0 && e.count("state = 'scheduled'") == 0 {
			break
		}
		if passes > 40 {
			t.Fatalf("%d passes and %d rows still scheduled: the burst goes out a row per pass", passes, e.count("state = 'scheduled'"))
		}
	}
	// 1,551 rows, 1,000 a claim; 1,500 of one key, about 256 promoted a pass.
	if passes > 12 {
		t.Errorf("%d passes (%d promotions) to publish the burst, want at most 12", passes, r.sched.rounds)
	}
	got := map[string][]int{}
	n := 0
	for _, m := range e.streamMsgs("ORDERS") {
		var key string
		var seq int
		if _, err := fmt.Sscanf(strings.Replace(string(m.Data), "/", " ", 1), "%s %d", &key, &seq); err != nil {
			t.Fatal(err)
		}
		got[key] = append(got[key], seq)
		n++
	}
	if n != hot+others*perOther+1 {
		t.Fatalf("%d messages in the stream, want %d", n, hot+others*perOther+1)
	}
	for key, seqs := range got {
		for i, s := range seqs {
			want := i
			if key == "k0" {
				want = i - 1 // its ready row first
			}
			if s != want {
				t.Fatalf("key %s: stream order %v, want its due order", key, seqs)
			}
		}
	}
	t.Logf("%d passes, %d promotions", passes, r.sched.rounds)
}

// A settle that finds fewer of the published rows ready than were published (another relay
// settled them, or row-level security hides them from the relay's role: they would be
// published again and again) says so once per state change, and counts every such row.
func TestSettleOfRowsNoLongerReadyIsLogged(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	logs := newEventLog()
	reg := prometheus.NewRegistry()
	r := e.relay(&Config{Logger: slog.New(logs), Registerer: reg})
	const warning, recovered = "settle found fewer of the published rows ready", "settle finds every published row ready again"
	short := func(context.Context, int) error {
		// Settled meanwhile by someone else.
		_, err := e.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'published' WHERE id = (SELECT min(id) FROM txoutbox_messages WHERE state = 'ready')`)
		return err
	}
	pass := func(hook func(context.Context, int) error, msgs int, warnings, recoveries int) {
		t.Helper()
		r.hooks.afterPublish = hook
		for range msgs {
			e.enqueue(outbox.Message{Subject: "orders.created"})
		}
		if n, err := r.runOnce(ctx); n != msgs || err != nil {
			t.Fatalf("runOnce = %d, %v, want %d rows", n, err, msgs)
		}
		if got := logs.count(slog.LevelWarn, warning); got != warnings {
			t.Fatalf("%d warnings about the rows the settle did not find, want %d", got, warnings)
		}
		if got := logs.count(slog.LevelInfo, recovered); got != recoveries {
			t.Fatalf("%d lines saying settles find every row again, want %d", got, recoveries)
		}
	}
	pass(short, 2, 1, 0)
	if st := r.Stats(); st.Published != 1 {
		t.Fatalf("Stats.Published = %d, want 1 (the row the settle found)", st.Published)
	}
	pass(short, 2, 1, 0) // still short: not logged again
	pass(nil, 1, 1, 1)   // every row found: one line says so
	pass(nil, 1, 1, 1)
	pass(short, 2, 2, 1) // short again: a new warning
	if got := testutil.ToFloat64(r.m.unsettled); got != 3 {
		t.Fatalf("txoutbox_relay_unsettled_total = %v, want 3", got)
	}
}
