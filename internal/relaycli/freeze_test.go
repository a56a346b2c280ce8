package relaycli

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

// A relay process stopped with SIGSTOP between publish and settle (its batch stored, not
// settled; the next batch possibly being sent) stays stopped for longer than the stream's
// duplicate window, the shortest the start check accepts, while producers keep enqueueing.
// The other relay fences it after 11 lease intervals, takes its partitions and republishes its
// unsettled rows inside the window. Woken with SIGCONT, the stopped relay finds its lease
// expired and sends nothing stale: the stream holds every message once, in order per key.
func TestStoppedRelayProcessStoresNothingStale(t *testing.T) {
	if testing.Short() {
		t.Skip("stops a relay for longer than a duplicate window (about 15s); not with -short")
	}
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	const parts = 4
	const lease = 100 * time.Millisecond
	flags := []string{"--partitions", strconv.Itoa(parts), "--lease-interval", lease.String(),
		"--publish-timeout", "1s", "--backoff-base", "10ms", "--backoff-max", "1s", "--handover-after", "off"}
	window := (&relay.Config{LeaseInterval: lease, PublishTimeout: time.Second, BackoffBase: 10 * time.Millisecond,
		BackoffMax: time.Second, HandoverAfter: txoutbox.Off}).WithDefaults().RequiredDuplicateWindow()
	ctx := context.Background()
	if _, err := n.JS.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}, Duplicates: window}); err != nil {
		t.Fatal(err)
	}
	q := store.New(db.Schema)
	start := func(name string, extra ...string) *proc {
		args := append([]string{"run", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema,
			"--relay-id", name, "--subjects", "orders.>", "--poll-max", "50ms", "--log-format", "json"}, flags...)
		return startRelay(t, name, append(args, extra...)...)
	}
	held := func() map[string]int {
		m, err := q.Membership(ctx, db.Pool, nil)
		if err != nil {
			t.Fatal(err)
		}
		byPID := map[int32]string{}
		for _, r := range m.Members {
			if r.Alive {
				byPID[r.PID] = r.RelayID
			}
		}
		out := map[string]int{}
		for _, l := range m.Locks {
			out[byPID[l.PID]]++
		}
		return out
	}
	victim := start("victim", "--fault-settle-delay", "200ms", "--log-level", "debug")
	testsvc.Eventually(t, 20*time.Second, "the victim to hold every partition", func() bool { return held()["victim"] == parts })
	other := start("other")
	testsvc.Eventually(t, 20*time.Second, "two relays holding 2 partitions each", func() bool {
		h := held()
		return h["victim"] == parts/2 && h["other"] == parts/2
	})

	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	const producers, keysPer = 2, 8
	var produced atomic.Int64
	pctx, stopProducers := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for w := 0; w < producers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			next := map[string]int{}
			for i := 0; pctx.Err() == nil; i++ {
				key := fmt.Sprintf("k%02d", w*keysPer+i%keysPer)
				payload := key + ":" + strconv.Itoa(next[key])
				err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
					_, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.freeze", Key: key, Payload: []byte(payload)})
					return err
				})
				if err != nil {
					t.Error(err)
					return
				}
				next[key]++
				produced.Add(1)
				time.Sleep(2 * time.Millisecond) // the producers' pace, not synchronisation
			}
		}(w)
	}
	defer func() { stopProducers(); wg.Wait() }()

	// Stop the victim while it lingers between publish and settle.
	const pause = "fault injection: pausing before settle"
	victim.waitLog(t, pause, 20*time.Second)
	if err := victim.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stoppedAt := time.Now()
	testsvc.Eventually(t, 20*time.Second, "the other relay to fence the victim and hold every partition", func() bool { return held()["other"] == parts })
	fencedAfter := time.Since(stoppedAt)
	// The fence counts the victim's silence from its last heartbeat, which may precede the
	// SIGSTOP by up to a lease interval: the silence the fencing relay measured is what must
	// reach 11 lease intervals.
	fence := other.waitLog(t, "ended the lease session of a relay that stopped heartbeating; its partitions are free", 5*time.Second)
	silent, err := time.ParseDuration(fmt.Sprint(fence.Fields["silent_for"]))
	if err != nil || silent < 11*lease || fencedAfter < 10*lease {
		t.Fatalf("the victim was fenced after %v of silence (%v), %s after it stopped; want at least 11 lease intervals (%s) of silence", fence.Fields["silent_for"], err, fencedAfter, 11*lease)
	}
	// Stay stopped past the duplicate window: anything the victim still sent from its batches
	// when it wakes would be stored again. (The length of the fault, not a synchronisation.)
	time.Sleep(time.Until(stoppedAt.Add(window + 2*time.Second)))
	if err := victim.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// It finds its session gone, comes back as a member and gets its share again.
	testsvc.Eventually(t, 30*time.Second, "the victim to rejoin and the shares to even out", func() bool {
		h := held()
		return h["victim"] == parts/2 && h["other"] == parts/2
	})
	stopProducers()
	wg.Wait()
	testsvc.Eventually(t, 30*time.Second, "the outbox to drain", func() bool {
		var left int
		if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM txoutbox_messages").Scan(&left); err != nil {
			t.Fatal(err)
		}
		return left == 0
	})
	for _, p := range []*proc{victim, other} {
		if code := p.stop(t, syscall.SIGTERM); code != 0 {
			t.Errorf("%s exited %d after SIGTERM, want 0", p.name, code)
		}
	}

	msgs := testsvc.StreamMsgs(t, n.JS, "ORDERS")
	ids := map[string]bool{}
	next := map[string]int{}
	for _, m := range msgs {
		id := m.Header.Get("Nats-Msg-Id")
		if ids[id] {
			t.Fatalf("message %s stored twice", id)
		}
		ids[id] = true
		key, seq, _ := strings.Cut(string(m.Data), ":")
		i, _ := strconv.Atoi(seq)
		if i != next[key] {
			t.Fatalf("key %s: stream has message %d where %d was due (order broken)", key, i, next[key])
		}
		next[key]++
	}
	if int64(len(msgs)) != produced.Load() {
		t.Fatalf("stream holds %d messages, %d were produced", len(msgs), produced.Load())
	}
	withheld := len(victim.find("this relay's partition lease ended before it could publish its whole batch (a pause, or partitions released or lost): " +
		"the rest is left to the relay that holds the partitions now"))
	// Messages the woken relay had handed to its NATS client before the stop and that were
	// still in the client's buffer: the write fence refused them (see relay.WriteFence).
	refused := len(victim.find("write fence: the NATS client was about to send messages handed to it under a partition lease that has ended since " +
		"(a pause of the relay between the hand-off and the write, or PubAcks that never came); " +
		"the connection is closed instead and reconnects, and the rows are left to the relay that holds the partitions now"))
	t.Logf("stopped for %s (duplicate window %s); fenced and taken over %s after the stop; %d messages, each once, in order; "+
		"batches the woken relay stopped sending: %d; writes its write fence refused: %d", (window + 2*time.Second).Round(time.Millisecond), window,
		fencedAfter.Round(time.Millisecond), len(msgs), withheld, refused)
}
