package relaycli

import (
	"context"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
	"github.com/txoutbox/txoutbox/relay"
)

// pausingProxy forwards TCP connections to a backend; Pause makes it stop moving bytes in
// both directions and stop connecting new clients to the backend (they are accepted and then
// left waiting), as a database host that stops answering without closing anything: a
// frozen VM, a network partition that drops packets.
type pausingProxy struct {
	ln      net.Listener
	backend string
	mu      sync.Mutex
	paused  bool
	resume  chan struct{} // closed by Resume
	conns   []net.Conn
}

func newPausingProxy(t *testing.T, backend string) *pausingProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &pausingProxy{ln: ln, backend: backend, resume: make(chan struct{})}
	t.Cleanup(func() {
		_ = ln.Close()
		p.Resume()
		p.mu.Lock()
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.serve(c)
		}
	}()
	return p
}

// Addr is the proxy's host:port.
func (p *pausingProxy) Addr() string { return p.ln.Addr().String() }

// Pause stops every byte until Resume.
func (p *pausingProxy) Pause() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.paused {
		p.paused, p.resume = true, make(chan struct{})
	}
}

// Resume lets bytes through again.
func (p *pausingProxy) Resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.paused {
		p.paused = false
		close(p.resume)
	}
}

// Drop closes every connection the proxy carries, both ends: the backend sees its clients
// gone, as when a frozen host is restarted.
func (p *pausingProxy) Drop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}

// gate blocks while the proxy is paused.
func (p *pausingProxy) gate() {
	p.mu.Lock()
	paused, ch := p.paused, p.resume
	p.mu.Unlock()
	if paused {
		<-ch
	}
}

func (p *pausingProxy) serve(c net.Conn) {
	p.gate()
	b, err := net.Dial("tcp", p.backend)
	if err != nil {
		_ = c.Close()
		return
	}
	p.mu.Lock()
	p.conns = append(p.conns, c, b)
	p.mu.Unlock()
	pipe := func(dst, src net.Conn) {
		buf := make([]byte, 32<<10)
		for {
			n, err := src.Read(buf)
			if n > 0 {
				p.gate() // a paused proxy holds what it read
				if _, werr := dst.Write(buf[:n]); werr != nil {
					break
				}
			}
			if err != nil {
				break
			}
		}
		if tc, ok := dst.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
	}
	go pipe(b, c)
	pipe(c, b)
}

// A relay stopped (SIGTERM) while PostgreSQL stops answering, its batch published and not
// yet settled, exits within relay.MaxStopTime: the settle of the batch in flight, the claim, the
// release of its partitions and the pool's close are bounded once it is told to stop, so
// that Kubernetes' terminationGracePeriodSeconds and systemd's TimeoutStopSec (30 s) never
// kill it. Its unsettled rows stay ready and are published again (JetStream drops the
// duplicates) by the next relay.
func TestRelayStopsInTimeWhenPostgresFreezes(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	ctx := context.Background()
	if _, err := n.JS.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}, Duplicates: 2 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(db.DSN)
	if err != nil || u.Host == "" {
		t.Skipf("the test PostgreSQL's DSN is not a URL with a host: %v", err)
	}
	proxy := newPausingProxy(t, u.Host)
	u.Host = proxy.Addr()
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	// A half message whose check is in flight when PostgreSQL freezes: its checker answers
	// once the proxy is paused, so that the check-back's record of the answer (and its giving
	// back of the claimed row) wait on the frozen database with timeouts of their own.
	if _, err := client.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.paid"}, &outbox.PrepareOptions{Group: "payments"}); err != nil {
		t.Fatal(err)
	}
	outboxID, err := checker.OutboxIdentity(ctx, db.Pool, db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	asked, answer := make(chan struct{}, 1), make(chan struct{})
	srv, err := checker.Serve(n.Conn, "payments", func(ctx context.Context, _ checker.Request) (outbox.LocalState, error) {
		select {
		case asked <- struct{}{}:
		default:
		}
		select {
		case <-answer:
		case <-ctx.Done():
		}
		return outbox.StateCommit, nil
	}, &checker.Config{Outbox: outboxID})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Stop() })
	p := startRelay(t, "relay", "run", "--database-url", u.String(), "--nats-url", n.URL(), "--schema", db.Schema,
		"--subjects", "orders.>", "--log-format", "json", "--log-level", "debug", "--fault-settle-delay", "300ms",
		"--metrics-addr", "127.0.0.1:0", "--check-transaction-timeout", "1ms", "--check-request-timeout", "30s")
	select {
	case <-asked:
	case <-time.After(30 * time.Second):
		t.Fatalf("the check-back did not ask the checker:\n%s", p.output())
	}
	// Then the batch: published, and PostgreSQL frozen before its settle.
	const msgs = 20
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		for i := range msgs {
			if _, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.x", Key: "k" + strconv.Itoa(i%4), Payload: []byte(strconv.Itoa(i))}); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	p.waitLog(t, "fault injection: pausing before settle", 30*time.Second)
	addr, _ := p.waitLog(t, "serving metrics, health and the status page", time.Second).Fields["addr"].(string)
	proxy.Pause()
	close(answer)
	// A scrape of the status page (which reads the outbox) hangs on the frozen database.
	go func() {
		resp, err := http.Get("http://" + addr + "/status.json")
		if err == nil {
			_ = resp.Body.Close()
		}
	}()
	t0 := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	bound := runStopBound(&relay.Config{}, false) // tracing off
	select {
	case <-p.done:
	case <-time.After(bound + 20*time.Second):
		_ = p.cmd.Process.Signal(syscall.SIGQUIT) // a goroutine dump says what it waits for
		<-p.done
		t.Fatalf("relay run still running %s after SIGTERM (bound %s)", bound+20*time.Second, bound)
	}
	took := time.Since(t0)
	if code := p.cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("relay run exited %d after SIGTERM, want 0", code)
	}
	if took > bound {
		t.Errorf("relay run took %s to exit after SIGTERM with PostgreSQL frozen, want at most %s (runStopBound)", took.Round(time.Millisecond), bound)
	}
	t.Logf("relay run exited %s after SIGTERM with PostgreSQL frozen mid-drain (bound %s)", took.Round(time.Millisecond), bound)

	// Nothing is lost: with the frozen sessions gone, another relay publishes what the first
	// one published but could not settle (the stream keeps each message once).
	proxy.Drop()
	next := startRelay(t, "next", "run", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema,
		"--subjects", "orders.>", "--log-format", "json", "--no-checkback")
	testsvc.Eventually(t, 30*time.Second, "the outbox to drain", func() bool {
		var left int
		if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM txoutbox_messages WHERE state <> 'prepared'").Scan(&left); err != nil {
			t.Fatal(err)
		}
		return left == 0
	})
	if code := next.stop(t, syscall.SIGTERM); code != 0 {
		t.Errorf("the next relay exited %d", code)
	}
	ids := map[string]bool{}
	for _, m := range testsvc.StreamMsgs(t, n.JS, "ORDERS") {
		ids[string(m.Data)] = true
	}
	if len(ids) != msgs {
		t.Errorf("the stream holds %d distinct messages, want %d", len(ids), msgs)
	}
}
