package relaycli

import (
	"context"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// secret is put in the database and NATS URLs of the relay processes; it must never appear in
// their logs.
const secret = "s3cr3t-Pa55"

func withSecrets(t *testing.T, dsn, natsURL string) (string, string) {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	if _, has := u.User.Password(); !has && u.User != nil {
		u.User = url.UserPassword(u.User.Username(), secret) // trust auth ignores it
	}
	n, err := url.Parse(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	n.User = url.UserPassword("relay", secret) // a server without auth ignores it
	return u.String(), n.String()
}

type observed struct {
	at        time.Time
	key       string
	seq       int
	partition int32
}

// Three relay processes share the partitions; one is killed with SIGKILL while producers keep
// enqueueing. Its partitions are taken over within about a lease interval, nothing is lost,
// the stream holds each message once and in order per key.
func TestFailoverThreeRelayProcesses(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	n.Stream(t, "ORDERS", "orders.>")
	const parts = 12
	const lease = time.Second
	dsn, natsURL := withSecrets(t, db.DSN, n.URL())
	q := store.New(db.Schema)
	ctx := context.Background()

	// Watch the subject as the relays publish, to time the takeover.
	var obsMu sync.Mutex
	var obs []observed
	sub, err := n.Conn.Subscribe("orders.>", func(m *nats.Msg) {
		key, seq, _ := strings.Cut(string(m.Data), ":")
		i, _ := strconv.Atoi(seq)
		obsMu.Lock()
		obs = append(obs, observed{at: time.Now(), key: key, seq: i, partition: store.KeyHash(key) % parts})
		obsMu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()

	names := []string{"relay-a", "relay-b", "relay-c"}
	procs := map[string]*proc{}
	for _, name := range names {
		args := []string{"run",
			"--database-url", dsn, "--nats-url", natsURL, "--schema", db.Schema,
			"--partitions", strconv.Itoa(parts), "--lease-interval", lease.String(), "--relay-id", name,
			"--poll-max", "100ms", "--metrics-addr", "127.0.0.1:0", "--log-format", "json", "--sample-interval", "500ms"}
		if name == "relay-a" {
			// The victim lingers between publish and settle, and says so, so that the kill
			// lands exactly there: its last batch is in the stream but still ready in the table.
			args = append(args, "--fault-settle-delay", "300ms", "--log-level", "debug")
		}
		procs[name] = startRelay(t, name, args...)
	}
	pids := func() (map[string]int32, map[int32][]int32) {
		m, err := q.Membership(ctx, db.Pool, nil)
		if err != nil {
			t.Fatal(err)
		}
		byName := map[string]int32{}
		for _, r := range m.Members {
			if r.Alive {
				byName[r.RelayID] = r.PID
			}
		}
		held := map[int32][]int32{}
		for _, l := range m.Locks {
			held[l.PID] = append(held[l.PID], l.Partition)
		}
		return byName, held
	}
	testsvc.Eventually(t, 20*time.Second, "three relays holding 4 partitions each", func() bool {
		byName, held := pids()
		if len(byName) != 3 {
			return false
		}
		for _, pid := range byName {
			if len(held[pid]) != parts/3 {
				return false
			}
		}
		return true
	})
	metricsAddr := map[string]string{}
	for _, name := range names {
		l := procs[name].waitLog(t, "serving metrics, health and the status page", 5*time.Second)
		metricsAddr[name], _ = l.Fields["addr"].(string)
	}

	// Producers: each owns its keys, so a key's sequence numbers are its commit order.
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	const producers, keysPer = 4, 12
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
					_, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.failover", Key: key, Payload: []byte(payload)})
					return err
				})
				if err != nil {
					t.Error(err)
					return
				}
				next[key]++
				produced.Add(1)
				time.Sleep(4 * time.Millisecond) // the producers' pace
			}
		}(w)
	}

	// Traffic flows through all three relays before the kill.
	testsvc.Eventually(t, 20*time.Second, "200 messages published on the subject", func() bool {
		obsMu.Lock()
		defer obsMu.Unlock()
		return len(obs) >= 200
	})
	victim := procs["relay-a"]
	const pause = "fault injection: pausing before settle"
	before := len(victim.find(pause))
	pauseTick := time.NewTicker(time.Millisecond) // the pause lasts 300ms: look often
	for len(victim.find(pause)) == before {
		<-pauseTick.C
	}
	pauseTick.Stop()
	byName, held := pids()
	victimParts := held[byName["relay-a"]]
	survivorPIDs := []int32{byName["relay-b"], byName["relay-c"]}
	producedAtKill := produced.Load()
	killAt := time.Now()
	if err := victim.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-victim.done

	// Time the takeover from pg_locks: when is each of the victim's partitions held again?
	var firstRetake, allRetaken time.Time
	lockTick := time.NewTicker(10 * time.Millisecond) // pg_locks is observed, not signalled
	defer lockTick.Stop()
	for deadline := time.Now().Add(15 * time.Second); allRetaken.IsZero(); <-lockTick.C {
		if time.Now().After(deadline) {
			t.Fatalf("the victim's partitions %v were not all taken over within 15s", victimParts)
		}
		_, held := pids()
		taken := 0
		for _, pid := range survivorPIDs {
			for _, p := range held[pid] {
				if slices.Contains(victimParts, p) {
					taken++
				}
			}
		}
		now := time.Now()
		if taken > 0 && firstRetake.IsZero() {
			firstRetake = now
		}
		if taken == len(victimParts) {
			allRetaken = now
		}
	}
	// The survivors publish the victim's partitions before the producers stop.
	testsvc.Eventually(t, 20*time.Second, "50 publishes of the victim's partitions after the takeover", func() bool {
		obsMu.Lock()
		defer obsMu.Unlock()
		n := 0
		for _, o := range obs {
			if o.at.After(allRetaken) && slices.Contains(victimParts, o.partition) {
				n++
			}
		}
		return n >= 50
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

	// Operators' view while the survivors run: status, readiness, metrics.
	code, statusOut, errOut := cli(t, "status", "--database-url", db.DSN, "--schema", db.Schema)
	if code != 0 {
		t.Fatalf("relay status = %d: %s", code, errOut)
	}
	if !strings.Contains(statusOut, "relay-a") || !strings.Contains(statusOut, "gone") {
		t.Errorf("relay status does not show the killed relay as gone:\n%s", statusOut)
	}
	// The survivors took the victim's partitions beyond their shares at once; they rebalance
	// to fair shares within a few lease intervals.
	rebalanced := time.Now()
	testsvc.Eventually(t, 10*time.Second, "the survivors to hold 6 partitions each", func() bool {
		for _, name := range names[1:] {
			body, code := testsvc.HTTPGet(t, "http://"+metricsAddr[name]+"/readyz")
			if code != 200 || !strings.HasPrefix(body, "ok: ok, partitions held 6") {
				return false
			}
		}
		return true
	})
	t.Logf("fair shares %s after the outbox drained", time.Since(rebalanced).Round(time.Millisecond))
	var dupTotal float64
	for _, name := range names[1:] {
		body, code := testsvc.HTTPGet(t, "http://"+metricsAddr[name]+"/readyz")
		if code != 200 || !strings.HasPrefix(body, "ok: ok, partitions held 6") {
			t.Errorf("%s /readyz = %d %q, want 200 with 6 partitions", name, code, body)
		}
		body, _ = testsvc.HTTPGet(t, "http://"+metricsAddr[name]+"/metrics")
		for _, l := range strings.Split(body, "\n") {
			if strings.HasPrefix(l, "txoutbox_relay_duplicates_total ") {
				v, _ := strconv.ParseFloat(strings.Fields(l)[1], 64)
				dupTotal += v
			}
		}
		if !strings.Contains(body, "txoutbox_relay_partitions_held 6") || !strings.Contains(body, "txoutbox_relay_relays 2") {
			t.Errorf("%s /metrics lacks the new shares (6 held, 2 relays)", name)
		}
	}
	for _, name := range names[1:] {
		if code := procs[name].stop(t, syscall.SIGTERM); code != 0 {
			t.Errorf("%s exited %d after SIGTERM, want 0", name, code)
		}
	}

	// Nothing lost, nothing stored twice, order per key kept.
	msgs := testsvc.StreamMsgs(t, n.JS, "ORDERS")
	if int64(len(msgs)) != produced.Load() {
		t.Fatalf("stream holds %d messages, %d were produced", len(msgs), produced.Load())
	}
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
	for _, p := range procs {
		if strings.Contains(p.output(), secret) {
			t.Errorf("%s logged a credential", p.name)
		}
	}

	// The timeline.
	obsMu.Lock()
	var lastBefore, resumed time.Time
	publishedCopies := len(obs)
	for _, o := range obs {
		if !slices.Contains(victimParts, o.partition) {
			continue
		}
		if o.at.Before(killAt) {
			lastBefore = o.at
		} else if resumed.IsZero() && o.at.After(firstRetake) {
			resumed = o.at
		}
	}
	obsMu.Unlock()
	if resumed.IsZero() {
		t.Fatal("no message of the victim's partitions was published after the takeover")
	}
	ms := func(a, b time.Time) string {
		return fmt.Sprintf("%+.0fms", float64(b.Sub(a))/float64(time.Millisecond))
	}
	t.Logf("failover timeline (3 relay processes, %d partitions, --lease-interval %s; victim held %v):", parts, lease, victimParts)
	t.Logf("  SIGKILL relay-a                                 t=0 (%d messages produced so far)", producedAtKill)
	t.Logf("  last publish of its partitions before the kill  %s", ms(killAt, lastBefore))
	t.Logf("  first of its partitions retaken (pg_locks)      %s", ms(killAt, firstRetake))
	t.Logf("  all of its partitions retaken                   %s", ms(killAt, allRetaken))
	t.Logf("  publishing of its partitions resumed            %s", ms(killAt, resumed))
	t.Logf("  produced %d; stream holds %d, each once; %d publishes seen on the subject; %.0f republishes absorbed by the duplicate window",
		produced.Load(), len(msgs), publishedCopies, dupTotal)
	t.Logf("relay status after the failover:\n%s", statusOut)
	if dupTotal == 0 {
		t.Error("the survivors republished none of the victim's published-but-unsettled batch: the kill missed the window")
	}
	if d := allRetaken.Sub(killAt); d > 3*lease+time.Second {
		t.Errorf("takeover took %s, want within about a lease interval (%s)", d, lease)
	}
}
