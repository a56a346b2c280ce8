package relay

import (
	"context"
	"io"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// A relay that cannot reach JetStream while others can hands its partitions over after
// HandoverAfter; their rows are published by the others; it rejoins when JetStream answers.
func TestHandoverWhenOnlyThisRelayLosesJetStream(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	proxy, js := e.proxiedJetStream(t)
	logs := &recordLog{}
	cfg := func(id string, log *slog.Logger) *Config {
		return &Config{ID: id, Schema: e.db.Schema, Partitions: 4, LeaseInterval: 50 * time.Millisecond, HandoverAfter: 300 * time.Millisecond,
			PublishTimeout: 200 * time.Millisecond, BackoffBase: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Logger: log}
	}
	cut, err := New(e.db.Pool, js, cfg("cut", slog.New(logs)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cut.Close)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cut.Run(ctx) }()
	defer func() { cancel(); <-done }()
	testsvc.Eventually(t, 10*time.Second, "the first relay to hold all 4", func() bool { return len(cut.Partitions()) == 4 })
	other := e.start(cfg("other", quietLogger()))
	testsvc.Eventually(t, 10*time.Second, "2/2", func() bool { return len(cut.Partitions()) == 2 && len(other.Partitions()) == 2 })

	proxy.cut()
	msgs := make([]outbox.Message, 40)
	for i := range msgs {
		msgs[i] = outbox.Message{Subject: "orders.created", Key: string(rune('a' + i%20))}
	}
	e.enqueue(msgs...)
	testsvc.Eventually(t, 15*time.Second, "the other relay to hold all 4 and publish everything", func() bool {
		return len(other.Partitions()) == 4 && e.count("true") == 0
	})
	if n := logs.countMsg(slog.LevelWarn, "this relay's NATS connection is down: its partitions are handed over to the relays that can publish; it rejoins when the connection is back"); n != 1 {
		t.Fatalf("%d handover lines, want 1", n)
	}
	if got := len(e.streamMsgs("ORDERS")); got != 40 {
		t.Fatalf("stream holds %d, want 40", got)
	}
	if h := cut.Health(); h != "nats_unavailable" {
		t.Fatalf("health of the relay that handed over = %q, want nats_unavailable (not ready)", h)
	}
	// A relay whose connection buffers publishes while reconnecting never hands over.
	if h := e.relay(nil).Config().HandoverAfter; h >= 0 {
		t.Fatalf("HandoverAfter = %s on a buffering connection, want off", h)
	}

	proxy.restore(t)
	testsvc.Eventually(t, 15*time.Second, "the relay to rejoin: 2/2 again", func() bool {
		return len(cut.Partitions()) == 2 && len(other.Partitions()) == 2
	})
	if n := logs.countMsg(slog.LevelInfo, "NATS is back: rejoining the partition shares"); n != 1 {
		t.Fatalf("%d rejoin lines, want 1", n)
	}
}

// tcpProxy forwards connections to target until cut, which closes them all and stops
// listening; restore listens on the same address again.
type tcpProxy struct {
	target, addr string
	mu           sync.Mutex
	ln           net.Listener
	conns        []net.Conn
}

func startProxy(t *testing.T, target string) *tcpProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &tcpProxy{target: target, addr: ln.Addr().String(), ln: ln}
	go p.serve(ln)
	t.Cleanup(p.cut)
	return p
}

func (p *tcpProxy) serve(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, u)
		p.mu.Unlock()
		pipe := func(dst, src net.Conn) { _, _ = io.Copy(dst, src); dst.Close(); src.Close() }
		go pipe(c, u)
		go pipe(u, c)
	}
}

func (p *tcpProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		p.ln.Close()
		p.ln = nil
	}
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

func (p *tcpProxy) restore(t *testing.T) {
	t.Helper()
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	go p.serve(ln)
}

// While JetStream is down and rows wait, the relay reports the outage once (it does not flap
// to healthy each time it starts a publish after a backoff), and once when it is over.
func TestOutageIsOneStateChange(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	logs := &recordLog{}
	r := e.start(&Config{PublishTimeout: 100 * time.Millisecond, PollMin: 5 * time.Millisecond,
		BackoffBase: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Logger: slog.New(logs)})
	testsvc.Eventually(t, 10*time.Second, "the relay to run", func() bool { return r.Health() == "ok" })
	e.nats.Stop()
	e.enqueue(outbox.Message{Subject: "orders.created", Key: "k"}, outbox.Message{Subject: "orders.created"})
	waitBackoff(t, r.Relay, 10*time.Second, "three failed publish attempts in a row", func(b backoffEvent) bool { return b.outage >= 3 })
	if d, h := logs.countMsg(slog.LevelWarn, "relay degraded; backing off and retrying"), logs.countMsg(slog.LevelInfo, "relay healthy"); d != 1 || h != 0 {
		t.Fatalf("during the outage: %d degraded and %d healthy lines, want 1 and 0", d, h)
	}
	if err := e.nats.Start(); err != nil {
		t.Fatal(err)
	}
	testsvc.Eventually(t, 15*time.Second, "the rows to be published", func() bool { return e.count("true") == 0 })
	testsvc.Eventually(t, 5*time.Second, "one recovery line", func() bool { return logs.countMsg(slog.LevelInfo, "relay healthy") == 1 })
}

// A relay whose outage backoff has grown long wakes as soon as its NATS connection is back.
func TestOutageBackoffEndsWhenNATSReconnects(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// PollMin 1s: the first outage wait is already 10s (±20%).
	r := e.start(&Config{PublishTimeout: 100 * time.Millisecond, PollMin: time.Second, PollMax: time.Second,
		BackoffBase: time.Second, BackoffMax: time.Minute, DisableDoorbell: true})
	testsvc.Eventually(t, 10*time.Second, "the relay to run", func() bool { return r.Health() == "ok" })
	e.nats.Stop()
	testsvc.Eventually(t, 5*time.Second, "the connection to notice NATS is gone", func() bool { return !e.nats.Conn.IsConnected() })
	e.enqueue(outbox.Message{Subject: "orders.created"})
	b := waitBackoff(t, r.Relay, 10*time.Second, "an outage wait of more than 5s", func(b backoffEvent) bool { return b.wait > 5*time.Second })
	t.Logf("the relay waits %s after %d failed passes", b.wait, b.outage)
	if err := e.nats.Start(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	testsvc.Eventually(t, 30*time.Second, "the row to be published", func() bool { return e.count("true") == 0 })
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("published %s after NATS came back, want within a few hundred ms of the reconnect", d)
	}
}

// An idle relay whose own NATS connection is down is not ready: its health says so without a
// row to publish (the /readyz answer and the health gauge agree), its handover clock starts
// then, and it is healthy again once the connection is back.
func TestIdleRelayWithItsConnectionDownIsNotReady(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	proxy, js := e.proxiedJetStream(t)
	logs := &recordLog{}
	r, err := New(e.db.Pool, js, &Config{ID: "idle", Schema: e.db.Schema, Partitions: 4, LeaseInterval: 50 * time.Millisecond,
		HandoverAfter: 300 * time.Millisecond, PollMin: 10 * time.Millisecond, PollMax: 50 * time.Millisecond,
		PublishTimeout: 200 * time.Millisecond, BackoffBase: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Logger: slog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	runUntilCleanup(t, r)
	testsvc.Eventually(t, 10*time.Second, "the relay to hold all 4 and be ok", func() bool {
		return len(r.Partitions()) == 4 && r.Health() == HealthOK
	})

	proxy.cut() // nothing is enqueued: the relay has nothing to publish
	testsvc.Eventually(t, 10*time.Second, "health nats_unavailable while idle", func() bool { return r.Health() == HealthNATSUnavailable })
	testsvc.Eventually(t, 10*time.Second, "the idle relay to hand its partitions over", func() bool { return len(r.Partitions()) == 0 })
	if n := logs.countMsg(slog.LevelWarn, "relay degraded; backing off and retrying"); n != 1 {
		t.Fatalf("%d degraded lines, want 1 (one per state change)", n)
	}
	if e.count("true") != 0 {
		t.Fatal("rows were enqueued: the test is about an idle relay")
	}

	proxy.restore(t)
	testsvc.Eventually(t, 15*time.Second, "health ok with its partitions back", func() bool {
		return r.Health() == HealthOK && len(r.Partitions()) == 4
	})
	e.enqueue(outbox.Message{Subject: "orders.created", Key: "k"})
	testsvc.Eventually(t, 10*time.Second, "the row published after the connection came back", func() bool { return e.count("true") == 0 })
}

// So is a relay on standby (every partition held by another): with its connection down it
// could not take over a partition's publishing either, and it is not ready until the
// connection is back, when it is on standby again.
func TestStandbyRelayWithItsConnectionDownIsNotReady(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := func(id string) *Config {
		return &Config{ID: id, Schema: e.db.Schema, Partitions: 1, LeaseInterval: 50 * time.Millisecond,
			HandoverAfter: 300 * time.Millisecond, PollMin: 10 * time.Millisecond, PollMax: 50 * time.Millisecond,
			PublishTimeout: 200 * time.Millisecond, BackoffBase: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Logger: quietLogger()}
	}
	holder := e.start(cfg("holder"))
	testsvc.Eventually(t, 10*time.Second, "the first relay to hold the partition", func() bool { return len(holder.Partitions()) == 1 })

	proxy, js := e.proxiedJetStream(t)
	standby, err := New(e.db.Pool, js, cfg("standby"))
	if err != nil {
		t.Fatal(err)
	}
	runUntilCleanup(t, standby)
	testsvc.Eventually(t, 10*time.Second, "the second relay on standby", func() bool { return standby.Health() == HealthStandby })

	proxy.cut()
	testsvc.Eventually(t, 10*time.Second, "the standby relay nats_unavailable", func() bool { return standby.Health() == HealthNATSUnavailable })
	if len(holder.Partitions()) != 1 || holder.Health() != HealthOK {
		t.Fatalf("the holder: %v partitions, health %s; want it untouched", holder.Partitions(), holder.Health())
	}
	proxy.restore(t)
	testsvc.Eventually(t, 15*time.Second, "the relay on standby again", func() bool { return standby.Health() == HealthStandby })
}

// proxiedJetStream is a JetStream on e's server through a TCP proxy the test can cut, on a
// connection without a reconnect buffer (a relay hands over only on such a connection).
func (e *env) proxiedJetStream(t *testing.T) (*tcpProxy, jetstream.JetStream) {
	t.Helper()
	proxy := startProxy(t, e.nats.URL()[len("nats://"):])
	nc, err := nats.Connect("nats://"+proxy.addr, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.ReconnectBufSize(-1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return proxy, js
}

// runUntilCleanup runs r until the test ends, then stops and closes it.
func runUntilCleanup(t *testing.T, r *Relay) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; r.Close() })
}
