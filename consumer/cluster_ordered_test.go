package consumer

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// TestOrderedAcrossCrashAndInstances on a three-node cluster with an R3 stream: an ordered
// instance dies (its connection closed: nothing acked, nak'ed or kept alive) while it holds
// unacked messages of a key, one of them in its handler; two new instances take over, are
// delivered the key's later messages and wait for the dead instance's ones; then the stream's
// leader is killed (it hands nothing over) while they consume, and more messages are published
// once a new leader is elected. Every message is applied exactly once, each key in publish
// order, and nothing is dead-lettered.
func TestClusterOrderedAcrossConsumerCrashAndLeaderKill(t *testing.T) {
	t.Parallel()
	start := time.Now()
	e := &env{t: t, db: testsvc.NewDB(t)}
	cl := testsvc.JetStreamCluster(t)
	cl.Stream(t, testStream, "orders.>")
	cl.Stream(t, deadStream, DefaultDeadLetterPrefix+">")
	e.exec(`CREATE TABLE applied (id bigserial PRIMARY KEY, k text NOT NULL, n int NOT NULL, seq bigint NOT NULL, idem text NOT NULL, by_instance text NOT NULL)`)

	keys := []string{"k0", "k1", "k2", "k3"}
	published := map[string]int{} // per key, the messages published (payload "<key>:<n>", n from 0)
	unkeyed := 0
	// publish stores a message as the relay would (a Nats-Msg-Id), asking again while the
	// stream has no leader: the id makes a repeated publish a duplicate, stored once.
	publish := func(key string) {
		t.Helper()
		m := nats.NewMsg("orders.created")
		m.Header.Set(outbox.HeaderMsgID, newID())
		if key != "" {
			m.Header.Set(outbox.HeaderKey, key)
			m.Data = fmt.Appendf(nil, "%s:%d", key, published[key])
			published[key]++
		} else {
			m.Data = fmt.Appendf(nil, "unkeyed:%d", unkeyed)
			unkeyed++
		}
		testsvc.Eventually(t, 30*time.Second, "a publish taken by the stream", func() bool {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			_, err := cl.JS.PublishMsg(ctx, m)
			return err == nil
		})
	}
	publishRound := func(rounds int) {
		for n := range rounds {
			for _, k := range keys {
				publish(k)
			}
			if n%4 == 0 {
				publish("")
			}
		}
	}
	publishRound(30)

	handler := func(name string, block func(msg Message)) Handler {
		return func(ctx context.Context, tx pgx.Tx, msg Message) error {
			if block != nil {
				block(msg)
			}
			n := 0
			if msg.Key != "" {
				k, num, _ := strings.Cut(string(msg.Payload), ":")
				var err error
				if n, err = strconv.Atoi(num); err != nil || k != msg.Key {
					return Permanent(fmt.Errorf("payload %q of key %q: %v", msg.Payload, msg.Key, err))
				}
			}
			_, err := tx.Exec(ctx, `INSERT INTO applied (k, n, seq, idem, by_instance) VALUES ($1, $2, $3, $4, $5)`,
				msg.Key, n, int64(msg.StreamSeq), msg.IdempotencyKey, name)
			return err
		}
	}
	cfg := &Config{
		Ordered:         true,
		FilterSubjects:  []string{"orders.created"},
		Concurrency:     3,
		PullMaxMessages: 8,
		AckWait:         2 * time.Second,
		// MaxDeliveries is the default 10; PullHeartbeat the default 2.5s.
	}
	start1 := func(name string, cfg *Config, h Handler, hk hooks) (*nats.Conn, *Consumer, func() error) {
		t.Helper()
		nc, err := testsvc.Connect(cl.URLs())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		cp := *cfg
		c := e.newConsumer(js, &cp, h)
		c.hooks = hk
		return nc, c, e.run(c)
	}

	// Instance a blocks in the handler of k0:2 and takes in k0's next messages (queued behind
	// it), then dies.
	blocked := make(chan struct{})
	release := make(chan struct{})
	var blockOnce sync.Once
	var heldK0 atomic.Int32
	aConn, _, aStop := start1("a", cfg, handler("a", func(msg Message) {
		if string(msg.Payload) != "k0:2" {
			return
		}
		blockOnce.Do(func() { close(blocked) })
		<-release
	}), hooks{admitted: func(msg Message) {
		if msg.Key == "k0" {
			heldK0.Add(1)
		}
	}})
	testsvc.Receive(t, blocked, 20*time.Second, "instance a in the handler of k0:2")
	testsvc.Eventually(t, 20*time.Second, "instance a holding k0's next messages", func() bool { return heldK0.Load() >= 6 })
	aConn.Close() // the crash: from now on a acks, naks and keeps alive nothing
	close(release)
	_ = aStop() // its commit of k0:2 may go through; its ack cannot
	appliedByA := e.count(`SELECT count(*) FROM applied`)

	// Two new instances; one of them runs in batch mode.
	waited := make(chan struct{})
	var waitOnce sync.Once
	var waits atomic.Int64
	hk := hooks{waiting: func(Message) {
		waits.Add(1)
		waitOnce.Do(func() { close(waited) })
	}}
	_, b, bStop := start1("b", cfg, handler("b", nil), hk)
	batchCfg := *cfg
	batchCfg.BatchSize = 8
	_, c, cStop := start1("c", &batchCfg, handler("c", nil), hk)
	// A later message of a key reached a new instance before the dead instance's earlier ones
	// were redelivered, and waits for them.
	testsvc.Receive(t, waited, 20*time.Second, "a message waiting for an earlier one of its key")

	// The stream's leader killed while they consume.
	total := len(keys)*30 + unkeyed
	old := cl.KillLeader(t, testStream)
	killedAt := time.Now()
	if n := e.count(`SELECT count(*) FROM applied`); n >= total {
		t.Fatalf("every message was applied before the leader was killed: the test proves nothing")
	}
	leader, err := cl.WaitStreamLeader(testStream, old, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	elected := time.Since(killedAt)
	publishRound(10)
	total = len(keys)*40 + unkeyed

	testsvc.Eventually(t, 60*time.Second, "every message applied", func() bool {
		return e.count(`SELECT count(*) FROM applied`) >= total
	})
	testsvc.Eventually(t, 30*time.Second, "every message acked", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		cons, err := cl.JS.Consumer(ctx, testStream, testDurable)
		if err != nil {
			return false
		}
		info, err := cons.Info(ctx)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	})
	if err := bStop(); err != nil {
		t.Fatalf("instance b: %v", err)
	}
	if err := cStop(); err != nil {
		t.Fatalf("instance c: %v", err)
	}

	if n := e.count(`SELECT count(*) FROM applied`); n != total {
		t.Fatalf("applied %d effects, want %d", n, total)
	}
	if n := e.count(`SELECT count(*) FROM (SELECT idem FROM applied GROUP BY idem HAVING count(*) > 1) d`); n != 0 {
		t.Fatalf("%d messages applied more than once", n)
	}
	rows, err := e.db.Pool.Query(context.Background(), `SELECT k, n, seq FROM applied WHERE k <> '' ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]int{}
	lastSeq := map[string]int64{}
	for rows.Next() {
		var k string
		var n int
		var seq int64
		if err := rows.Scan(&k, &n, &seq); err != nil {
			t.Fatal(err)
		}
		if seq <= lastSeq[k] {
			t.Errorf("key %s: stream sequence %d applied after %d", k, seq, lastSeq[k])
		}
		lastSeq[k] = seq
		got[k] = append(got[k], n)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		for i, n := range got[k] {
			if n != i {
				t.Errorf("key %s: applied in the order %v, want 0..%d in publish order", k, got[k], published[k]-1)
				break
			}
		}
		if len(got[k]) != published[k] {
			t.Errorf("key %s: %d applied, %d published", k, len(got[k]), published[k])
		}
	}
	// The dead-letter stream (R3) lost a node too: its leader may still be being elected.
	if _, err := cl.WaitStreamLeader(deadStream, nil, 60*time.Second); err != nil {
		t.Fatal(err)
	}
	if dead := testsvc.StreamMsgs(t, cl.JS, deadStream); len(dead) != 0 {
		t.Errorf("%d dead letters, want none (first: %q, %s)", len(dead), dead[0].Data, dead[0].Header.Get(HeaderDeadReason))
	}
	byB := e.count(`SELECT count(*) FROM applied WHERE by_instance = 'b'`)
	byC := e.count(`SELECT count(*) FROM applied WHERE by_instance = 'c'`)
	t.Logf("%d messages applied once each, keys in publish order: %d by the crashed instance, %d and %d by the two others; "+
		"%d waits; %d+%d read back; leader %s killed → %s elected in %s; test %s",
		total, appliedByA, byB, byC, waits.Load(), scannedBy(b), scannedBy(c),
		old.Name, leader.Name, elected.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// scannedBy is how many stream messages an ordered consumer read back, 0 for one whose Run
// stopped before its setup passed (an instance started just before the leader kill may still
// be waiting for JetStream when the others have applied everything).
func scannedBy(c *Consumer) uint64 {
	if c.order == nil {
		return 0
	}
	return c.order.scannedMessages()
}
