package relaycli

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/relay"
)

// The relay binary's pool turns JIT compilation off after connecting (never as a startup
// parameter, which poolers such as PgBouncer refuse), unless the URL sets jit itself.
func TestPoolTurnsJITOff(t *testing.T) {
	ctx := context.Background()
	base := testsvc.PostgresDSN(t)
	for _, tc := range []struct {
		dsn  string
		want string
	}{
		{base, "off"},
		{withOptions(base, "-c jit=on"), "on"},
		{withOptions(base, "-cjit=on"), "on"},
		{withOptions(base, "-c jit_above_cost=100000"), "off"}, // another jit setting: jit itself is still turned off
	} {
		c, err := connect(ctx, connectOptions{DSN: tc.dsn, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		var jit string
		err = c.Pool.QueryRow(ctx, "SELECT current_setting('jit')").Scan(&jit)
		c.Close()
		if err != nil || jit != tc.want {
			t.Errorf("%s: jit = %q (%v), want %q", tc.dsn, jit, err, tc.want)
		}
	}
}

// withOptions adds an options parameter (server settings, "-c name=value") to a URL or a
// keyword/value connection string.
func withOptions(dsn, options string) string {
	switch {
	case !strings.HasPrefix(dsn, "postgres://") && !strings.HasPrefix(dsn, "postgresql://"):
		return dsn + " options='" + options + "'"
	case strings.Contains(dsn, "?"):
		return dsn + "&options=" + strings.ReplaceAll(url.QueryEscape(options), "+", "%20")
	}
	return dsn + "?options=" + strings.ReplaceAll(url.QueryEscape(options), "+", "%20")
}

// The commands' NATS connection is dialled through a relay.WriteFence and buffers nothing
// while it reconnects, so that relay.New binds the fence: a relay paused between handing a
// message to the client and the client's write never sends it after its lease ended.
func TestNATSConnectionIsWriteFenced(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	n := testsvc.NewNATS(t)
	c, err := connect(ctx, connectOptions{DSN: testsvc.PostgresDSN(t), NATSURL: n.URL(), NeedNATS: true,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, ok := c.NC.Opts.CustomDialer.(*relay.WriteFence); !ok || c.NC.Opts.ReconnectBufSize != -1 {
		t.Fatalf("NATS connection dialer %T, reconnect buffer %d; want a *relay.WriteFence and -1", c.NC.Opts.CustomDialer, c.NC.Opts.ReconnectBufSize)
	}
	if !c.NC.IsConnected() {
		t.Fatal("the fenced connection is not connected")
	}
}

// A NATS server that stops answering without closing the connection (a network cut with no
// reset) is noticed within seconds: the connection leaves CONNECTED, so the relay's handover
// clock runs (nats.go's default keepalive took minutes, while every publish timed out and the
// relay kept its partitions).
func TestHalfOpenNATSConnectionIsNoticed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	n := testsvc.NewNATS(t)
	proxy := newPausingProxy(t, strings.TrimPrefix(n.URL(), "nats://"))
	c, err := connect(ctx, connectOptions{DSN: testsvc.PostgresDSN(t), NATSURL: "nats://" + proxy.Addr(), NeedNATS: true,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.NC.Opts.PingInterval != natsPingInterval || c.NC.Opts.MaxPingsOut != natsMaxPingsOut {
		t.Fatalf("ping interval %s, max pings out %d", c.NC.Opts.PingInterval, c.NC.Opts.MaxPingsOut)
	}
	proxy.Pause() // every byte held, the sockets open
	start := time.Now()
	bound := natsPingInterval*(natsMaxPingsOut+1) + 5*time.Second
	testsvc.Eventually(t, bound, "the connection to leave CONNECTED", func() bool { return !c.NC.IsConnected() })
	t.Logf("half-open connection noticed after %s", time.Since(start).Round(time.Millisecond))
	proxy.Resume()
	testsvc.Eventually(t, 15*time.Second, "the connection back", func() bool { return c.NC.IsConnected() })
}

// A PostgreSQL connection attempt is bounded when the connection string sets no
// connect_timeout (pgx waits for ever by default): a server that accepts the TCP connection
// and never answers hung relay status, dead list, migrate status and checkback --once for
// ever. connect_timeout in the string still wins.
func TestPostgresConnectAttemptIsBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	base := testsvc.PostgresDSN(t)
	for _, tc := range []struct {
		dsn  string
		want time.Duration
	}{
		{base, pgConnectTimeout},
		{withParam(base, "connect_timeout", "3"), 3 * time.Second},
		{withParam(base, "connect_timeout", "0"), 0}, // as in libpq: wait for ever, as asked
	} {
		c, err := connect(ctx, connectOptions{DSN: tc.dsn, Log: quiet})
		if err != nil {
			t.Fatal(err)
		}
		got := c.Pool.Config().ConnConfig.ConnectTimeout
		c.Close()
		if got != tc.want {
			t.Errorf("%s: connect timeout %s, want %s", tc.dsn, got, tc.want)
		}
	}

	for dsn, want := range map[string]bool{
		"host=h user=u":                                   false,
		"host=h connect_timeout=0":                        true,
		"host=h connect_timeout = '5'":                    true,
		"postgres://h/db":                                 false,
		"postgres://h/db?connect_timeout=0":               true,
		"postgresql://h/db?sslmode=disable":               false,
		"postgres://h/db?x=1&connect_timeout":             true,
		"postgres://h1:5432,h2:5432/db?connect_timeout=0": true, // multi-host: no net/url URL
		"postgres://h1:5432,h2:5432/db":                   false,
	} {
		if got := connectTimeoutSet(dsn); got != want {
			t.Errorf("connectTimeoutSet(%q) = %v, want %v", dsn, got, want)
		}
	}

	// A server that accepts and says nothing.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = conn.Close() })
		}
	}()
	dsn := "postgres://u:Secret-pw@" + ln.Addr().String() + "/db?sslmode=disable"
	c, err := connect(ctx, connectOptions{DSN: dsn, Log: quiet, ConnectTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	done := make(chan error, 1)
	go func() { done <- c.Pool.Ping(ctx) }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("Ping of a server that never answers succeeded")
		}
		if !strings.Contains(err.Error(), "timeout") {
			t.Errorf("Ping of a server that never answers = %v, want a timeout", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a connection attempt to a server that never answers hung")
	}
}

// withParam adds name=value to a URL or a keyword/value connection string.
func withParam(dsn, name, value string) string {
	switch {
	case !strings.HasPrefix(dsn, "postgres://") && !strings.HasPrefix(dsn, "postgresql://"):
		return dsn + " " + name + "=" + value
	case strings.Contains(dsn, "?"):
		return dsn + "&" + name + "=" + value
	}
	return dsn + "?" + name + "=" + value
}
