package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// running is a relay whose Run loop runs in the background.
type running struct {
	*Relay
	stop func() error
}

func (e *env) start(cfg *Config) *running {
	e.t.Helper()
	r := e.relay(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	var err error
	stop := func() error {
		once.Do(func() { cancel(); err = <-done })
		return err
	}
	e.t.Cleanup(func() { _ = stop() })
	return &running{Relay: r, stop: stop}
}

// leases reads who holds which partition from pg_locks (the truth, not the relays' view).
func (e *env) leases() store.Membership {
	e.t.Helper()
	q := store.New(e.db.Schema)
	m, err := q.Membership(context.Background(), e.db.Pool, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	return m
}

func shares(rs ...*running) []int {
	out := make([]int, len(rs))
	for i, r := range rs {
		out[i] = len(r.Partitions())
	}
	return out
}

// Relays joining and leaving: shares even out, every partition stays covered, and messages
// enqueued all along are published once each, in order per key.
func TestRebalanceJoinAndLeave(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const parts = 8
	cfg := func(id string) *Config {
		return &Config{ID: id, Partitions: parts, LeaseInterval: 50 * time.Millisecond, BatchSize: 20, PollMax: 20 * time.Millisecond}
	}
	// Producers enqueue keyed messages during the whole test.
	ctx, stopProducers := context.WithCancel(context.Background())
	var produced atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; ctx.Err() == nil; i++ {
				key := fmt.Sprintf("w%d-k%d", w, i%10)
				// Not ctx: a commit cut short by the stop would leave the count unsure.
				bg := context.Background()
				err := pgx.BeginFunc(bg, e.db.Pool, func(tx pgx.Tx) error {
					_, err := e.client.EnqueueTx(bg, tx, outbox.Message{Subject: "orders.seq", Key: key, Payload: []byte(key + ":" + strconv.Itoa(i/10))})
					return err
				})
				if err != nil {
					t.Error(err)
					return
				}
				produced.Add(1)
				time.Sleep(2 * time.Millisecond) // the producers' pace
			}
		}(w)
	}

	a := e.start(cfg("a"))
	testsvc.Eventually(t, 5*time.Second, "a to take every partition", func() bool { return len(a.Partitions()) == parts })
	b := e.start(cfg("b"))
	testsvc.Eventually(t, 5*time.Second, "a and b to hold 4 each", func() bool { return slices.Equal(shares(a, b), []int{4, 4}) })
	c := e.start(cfg("c"))
	// The oldest relays get the larger shares: 3, 3, 2.
	testsvc.Eventually(t, 5*time.Second, "shares 3/3/2", func() bool { return slices.Equal(shares(a, b, c), []int{3, 3, 2}) })
	m := e.leases()
	if len(m.Locks) != parts {
		t.Fatalf("pg_locks shows %d partition leases, want %d", len(m.Locks), parts)
	}
	if l := c.Lease(); l.Target != 2 || l.Relays != 3 {
		t.Fatalf("c's lease view = %+v, want target 2 of 3 relays", l)
	}

	// b leaves gracefully: a and c share its partitions.
	if err := b.stop(); err != nil {
		t.Fatal(err)
	}
	testsvc.Eventually(t, 5*time.Second, "a and c to hold 4 each", func() bool { return slices.Equal(shares(a, c), []int{4, 4}) })
	// a leaves too: c takes everything. (A relay killed with SIGKILL: see the failover test
	// in internal/relaycli.)
	if err := a.stop(); err != nil {
		t.Fatal(err)
	}
	testsvc.Eventually(t, 5*time.Second, "c to hold every partition", func() bool { return len(c.Partitions()) == parts })

	stopProducers()
	wg.Wait()
	testsvc.Eventually(t, 20*time.Second, "everything published", func() bool { return e.count("true") == 0 })
	_ = c.stop()

	msgs := e.streamMsgs("ORDERS")
	if int64(len(msgs)) != produced.Load() {
		t.Fatalf("stream holds %d messages, produced %d", len(msgs), produced.Load())
	}
	next := map[string]int{}
	for _, msg := range msgs {
		key, n, _ := strings.Cut(string(msg.Data), ":")
		i, _ := strconv.Atoi(n)
		if i != next[key] {
			t.Fatalf("key %s: got message %d, want %d (order broken across a handover)", key, i, next[key])
		}
		next[key]++
	}
	t.Logf("%d messages published across join and leave, order per key kept", len(msgs))
}

// More relays than partitions: the extra ones stand by and take over when a holder leaves.
func TestMoreRelaysThanPartitions(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := func(id string) *Config { return &Config{ID: id, Partitions: 2, LeaseInterval: 50 * time.Millisecond} }
	a := e.start(cfg("a"))
	testsvc.Eventually(t, 5*time.Second, "a to hold both", func() bool { return len(a.Partitions()) == 2 })
	b := e.start(cfg("b"))
	c := e.start(cfg("c")) // b and c start together: which of them is older is up to chance
	testsvc.Eventually(t, 5*time.Second, "1/1/0", func() bool {
		s := shares(a, b, c)
		return s[0] == 1 && s[1]+s[2] == 1
	})
	standby := c
	if len(c.Partitions()) == 1 {
		standby = b
	}
	testsvc.Eventually(t, 5*time.Second, "the third relay on standby", func() bool { return standby.Health() == "standby" })
	_ = a.stop()
	testsvc.Eventually(t, 5*time.Second, "the standby to take a's partition", func() bool { return slices.Equal(shares(b, c), []int{1, 1}) })
}

func TestPartitionCountMismatchRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var rounds <-chan round
	a := e.startWith(&Config{ID: "a", Partitions: 8, LeaseInterval: 50 * time.Millisecond}, func(r *Relay) { rounds = roundsOf(r) })
	testsvc.Eventually(t, 5*time.Second, "a to hold every partition", func() bool { return len(a.Partitions()) == 8 })

	b := e.relay(&Config{ID: "b", Partitions: 4, LeaseInterval: 50 * time.Millisecond})
	err := b.Run(context.Background())
	refused := time.Now()
	var me *PartitionMismatchError
	if !errors.Is(err, ErrPartitionMismatch) || !errors.As(err, &me) || me.Partitions != 4 || len(me.Others) != 1 {
		t.Fatalf("b.Run = %v, want a PartitionMismatchError naming a's 8", err)
	}
	for id, n := range me.Others {
		if !strings.HasSuffix(id, "/a") || n != 8 {
			t.Fatalf("mismatch names %s with %d", id, n)
		}
	}
	if !strings.Contains(err.Error(), "Config.Partitions (relay run --partitions) 4") {
		t.Fatalf("error %q does not say what to fix", err)
	}
	// b never took anything and left the membership table; a keeps going.
	for _, m := range e.leases().Members {
		if strings.HasSuffix(m.RelayID, "/b") {
			t.Fatalf("b left its membership row behind: %+v", m)
		}
	}
	for range 3 { // a's lease rounds after the refusal
		nextRound(t, rounds, "a lease round of a after b's refusal", func(rd round) bool { return rd.start.After(refused) })
	}
	if got := len(a.Partitions()); got != 8 {
		t.Fatalf("a holds %d after b's refusal, want 8", got)
	}
	e.enqueue(outbox.Message{Subject: "orders.created"})
	testsvc.Eventually(t, 5*time.Second, "a still publishing", func() bool { return e.count("true") == 0 })
}

// The sampled gauges: backlog and oldest age per held partition, rows by state.
func TestSampledBacklogMetrics(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	reg := prometheus.NewRegistry()
	r := e.relay(&Config{Partitions: 4, Registerer: reg})
	ctx := context.Background()
	if _, _, err := r.lease.acquire(ctx); err != nil { // take the partitions, publish nothing
		t.Fatal(err)
	}
	var msgs []outbox.Message
	for i := 0; i < 7; i++ {
		msgs = append(msgs, outbox.Message{Subject: "orders.created", Key: "k" + strconv.Itoa(i)})
	}
	ids := e.enqueue(msgs...)
	if _, err := e.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'dead', attempts = 3 WHERE message_id = ANY($1)`, ids[:2]); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET ready_at = now() - interval '90 seconds' WHERE message_id = $1`, ids[2]); err != nil {
		t.Fatal(err)
	}
	if err := r.sampleOnce(ctx); err != nil {
		t.Fatal(err)
	}
	fams := gather(t, reg)
	var backlog, oldest float64
	var series int
	for _, m := range fams["txoutbox_relay_ready_backlog"] {
		backlog += m.GetGauge().GetValue()
		series++
	}
	for _, m := range fams["txoutbox_relay_oldest_ready_age_seconds"] {
		oldest = max(oldest, m.GetGauge().GetValue())
	}
	if backlog != 5 || series != 4 {
		t.Fatalf("ready backlog = %v over %d partitions, want 5 over 4", backlog, series)
	}
	if oldest < 89 || oldest > 120 {
		t.Fatalf("oldest ready age = %v, want about 90s", oldest)
	}
	states := map[string]float64{}
	for _, m := range fams["txoutbox_outbox_messages"] {
		states[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
	}
	if states["ready"] != 5 || states["dead"] != 2 || states["prepared"] != 0 {
		t.Fatalf("rows by state = %v", states)
	}
	if v := fams["txoutbox_relay_partitions_held"][0].GetGauge().GetValue(); v != 4 {
		t.Fatalf("partitions held = %v", v)
	}
	// Per subject: the same backlog and oldest age, labelled with the subject (once the
	// subject has no ready row, its series go: below).
	subj := fams["txoutbox_outbox_subject_ready"]
	if len(subj) != 1 || subj[0].GetLabel()[0].GetValue() != "orders.created" || subj[0].GetGauge().GetValue() != 5 {
		t.Fatalf("ready rows by subject = %v, want orders.created 5", subj)
	}
	if a := fams["txoutbox_outbox_subject_oldest_ready_age_seconds"]; len(a) != 1 || a[0].GetGauge().GetValue() < 89 || a[0].GetGauge().GetValue() > 120 {
		t.Fatalf("oldest ready age by subject = %v, want about 90s", a)
	}
	// The cap bounds the counts.
	capped := e.relay(&Config{Partitions: 4, SampleLimit: 3, Registerer: prometheus.NewRegistry()})
	c, err := capped.q.SampleStates(ctx, e.db.Pool, 3)
	if err != nil || c.Ready != 3 {
		t.Fatalf("capped ready count = %d, %v; want 3", c.Ready, err)
	}
	if _, err := e.db.Pool.Exec(ctx, `DELETE FROM txoutbox_messages WHERE state = 'ready'`); err != nil {
		t.Fatal(err)
	}
	if err := r.sampleOnce(ctx); err != nil {
		t.Fatal(err)
	}
	fams = gather(t, reg)
	if n := len(fams["txoutbox_outbox_subject_ready"]) + len(fams["txoutbox_outbox_subject_oldest_ready_age_seconds"]); n != 0 {
		t.Fatalf("%d subject series left after the subject's rows went", n)
	}
}

func gather(t *testing.T, g prometheus.Gatherer) map[string][]*dto.Metric {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]*dto.Metric{}
	for _, mf := range mfs {
		out[mf.GetName()] = mf.GetMetric()
	}
	return out
}

// A W3C traceparent (and tracestate) given at enqueue is on the published JetStream message,
// byte for byte.
func TestTraceparentReachesTheStream(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	const ts = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
	e.enqueue(outbox.Message{Subject: "orders.created", Key: "o1", Payload: []byte("x"),
		Headers: map[string][]string{"traceparent": {tp}, "tracestate": {ts}}})
	r := e.start(&Config{})
	testsvc.Eventually(t, 10*time.Second, "published", func() bool { return e.count("true") == 0 })
	_ = r.stop()
	msgs := e.streamMsgs("ORDERS")
	if len(msgs) != 1 {
		t.Fatalf("stream holds %d", len(msgs))
	}
	if got := msgs[0].Header.Values("traceparent"); len(got) != 1 || got[0] != tp {
		t.Fatalf("traceparent on the stream = %q, want %q", got, tp)
	}
	if got := msgs[0].Header.Get("tracestate"); got != ts {
		t.Fatalf("tracestate on the stream = %q, want %q", got, ts)
	}
}

// A relay with another partition count appearing while a relay runs: the running one keeps
// publishing but reports the mismatch (metric, Lease().Mismatch) until it is gone.
func TestPartitionCountMismatchReportedWhileRunning(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	reg := prometheus.NewRegistry()
	a := e.start(&Config{ID: "a", Partitions: 8, LeaseInterval: 50 * time.Millisecond, Registerer: reg})
	testsvc.Eventually(t, 5*time.Second, "a to hold every partition", func() bool { return len(a.Partitions()) == 8 })

	// Another relay's registration, alive because its session is.
	ctx := context.Background()
	conn, err := e.db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	q := store.New(e.db.Schema)
	odd := store.RelayRegistration{Instance: uuid.New(), RelayID: "odd", Partitions: 16, LeaseInterval: time.Second}
	if err := q.RegisterRelay(ctx, conn, odd); err != nil {
		t.Fatal(err)
	}
	mismatch := func() float64 {
		return gather(t, reg)["txoutbox_relay_partition_count_mismatch"][0].GetGauge().GetValue()
	}
	testsvc.Eventually(t, 5*time.Second, "a to report the mismatch", func() bool { return a.Lease().Mismatch && mismatch() == 1 })
	e.enqueue(outbox.Message{Subject: "orders.created"})
	testsvc.Eventually(t, 5*time.Second, "a still publishing", func() bool { return e.count("true") == 0 })
	if got := len(a.Partitions()); got != 8 {
		t.Fatalf("a holds %d, want 8: a relay with another count is not a member to share with", got)
	}
	if err := q.UnregisterRelay(ctx, conn, odd.Instance); err != nil {
		t.Fatal(err)
	}
	testsvc.Eventually(t, 5*time.Second, "the mismatch to clear", func() bool { return !a.Lease().Mismatch && mismatch() == 0 })
}

// A relay that stops heartbeating while its session lives on (frozen: SIGSTOP, a hung
// process) is fenced: another relay, once it has watched that heartbeat unchanged for 11 lease
// intervals on its own clock (never earlier), ends its session and takes its partitions, and
// the rows waiting there are published. The frozen relay's lease has expired by then: when it
// comes back it holds nothing and publishes nothing.
func TestFrozenRelayIsFenced(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	const lease = 50 * time.Millisecond
	frozen := e.relay(&Config{ID: "frozen", Partitions: 4, LeaseInterval: lease})
	if _, err := frozen.runOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if len(frozen.Partitions()) != 4 {
		t.Fatalf("the first relay holds %v, want all 4", frozen.Partitions())
	}
	// It never runs again.
	e.enqueue(outbox.Message{Subject: "orders.created", Key: "k", Payload: []byte("waiting")})
	logs := &recordLog{}
	var rounds <-chan round
	started := time.Now()
	e.startWith(&Config{ID: "other", Partitions: 4, LeaseInterval: lease, Logger: slog.New(logs)}, func(r *Relay) { rounds = roundsOf(r) })
	rd := nextRound(t, rounds, "the other relay to take all 4", func(rd round) bool { return len(rd.st.Held) > 0 })
	if len(rd.st.Held) != 4 {
		t.Fatalf("the other relay took %v, want all 4 at once", rd.st.Held)
	}
	if early := started.Add(fenceFactor * lease); rd.start.Before(early) {
		t.Fatalf("the other relay fenced %s after it started, before %s of silence could have been seen", rd.start.Sub(started), fenceFactor*lease)
	}
	testsvc.Eventually(t, 10*time.Second, "the waiting row to be published", func() bool { return e.count("true") == 0 })
	if n := logs.countMsg(slog.LevelWarn, "ended the lease session of a relay that stopped heartbeating; its partitions are free"); n != 1 {
		t.Fatalf("%d fence lines, want 1", n)
	}
	// The frozen relay comes back: its lease connection is gone, so it holds nothing.
	_, _ = frozen.runOnce(ctx)
	if got := frozen.Partitions(); len(got) != 0 {
		t.Fatalf("the fenced relay still holds %v", got)
	}
	if got := len(e.streamMsgs("ORDERS")); got != 1 {
		t.Fatalf("stream holds %d, want 1", got)
	}
}

// A relay is "starting" (not ready) until its first round ends, then "ok".
func TestHealthStartsAsStarting(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(nil)
	if h := r.Health(); h != "starting" {
		t.Fatalf("health before Run = %q, want starting", h)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); <-done }()
	testsvc.Eventually(t, 10*time.Second, "health ok", func() bool { return r.Health() == "ok" })
}

// The health gauge: 1 for the relay's current state and 0 for the others, from before the
// first round (starting) to publishing (ok).
func TestHealthGauge(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	reg := prometheus.NewRegistry()
	health := func() map[string]float64 {
		out := map[string]float64{}
		for _, m := range gather(t, reg)["txoutbox_relay_health"] {
			out[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
		}
		return out
	}
	want := func(state Health) map[string]float64 {
		out := map[string]float64{}
		for _, h := range healthStates {
			out[string(h)] = 0
		}
		out[string(state)] = 1
		return out
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r := e.relay(&Config{Registerer: reg})
	if got := health(); !maps.Equal(got, want(HealthStarting)) {
		t.Fatalf("health gauges before Run = %v, want %v", got, want(HealthStarting))
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	testsvc.Eventually(t, 10*time.Second, "the relay to publish", func() bool { return r.Health() == HealthOK })
	if got := health(); !maps.Equal(got, want(HealthOK)) {
		t.Fatalf("health gauges of the running relay = %v, want %v", got, want(HealthOK))
	}
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
}
