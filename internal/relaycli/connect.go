package relaycli

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/cmdline"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/redact"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/relay"
)

// DefaultNATSURL is used when neither --nats-url nor NATS_URL is set.
const DefaultNATSURL = nats.DefaultURL

// conns are the connections a command uses, plus what to stop on exit.
type conns struct {
	DSN     string
	NATSURL string
	Pool    *pgxpool.Pool
	NC      *nats.Conn
	// NATSDown is why NATS did not answer a command that does not wait (NC then connects in
	// the background); nil when it answered.
	NATSDown error
	cleanup  []func()

	// closing is set by Close before it closes NC: a close nats.go reports after it is ours.
	closing atomic.Bool
	// natsLost is closed, and natsLostErr set, when nats.go closes NC for good by itself (it
	// then never reconnects: after the server refused the credentials twice in a row, for
	// example after a password rotation or with an expired or revoked user JWT).
	lostOnce    sync.Once
	natsLost    chan struct{}
	natsLostErr error
	// natsAuthErr is the last refusal of the credentials nats.go reported (its sentinel:
	// the error it closes with may be the server's text, which not every sentinel matches).
	natsAuthErr atomic.Pointer[error]
}

// errNATSClosed: nats.go closed the NATS connection for good (it does not reconnect again);
// a daemon ends with it (exit status 1) so that its supervisor restarts it.
var errNATSClosed = errors.New("NATS closed the connection for good and will not reconnect")

// lost records that nats.go closed NC by itself, with the last error it saw, and reports
// whether it did (not after Close, only once).
func (c *conns) lost(nc *nats.Conn, tlsFirst bool) (recorded bool) {
	if c.closing.Load() {
		return false
	}
	c.lostOnce.Do(func() {
		recorded = true
		err := nc.LastError()
		if err == nil {
			err = nats.ErrConnectionClosed
		}
		if auth := c.natsAuthErr.Load(); auth != nil && !natsAuthRefusal(err) {
			// "nats: User Authentication Expired" is not nats.ErrAuthExpired for errors.Is.
			err = fmt.Errorf("%w (%w)", *auth, err)
		}
		c.natsLostErr = fmt.Errorf("%w: %w; exiting so that the supervisor restarts the process", errNATSClosed, natsHint(err, tlsFirst))
		close(c.natsLost)
	})
	return recorded
}

// NATSLost returns a channel closed when nats.go closed the connection for good by itself
// (see errNATSClosed), and the error saying why once it is.
func (c *conns) NATSLost() (<-chan struct{}, func() error) {
	return c.natsLost, func() error {
		select {
		case <-c.natsLost:
			return c.natsLostErr
		default:
			return nil
		}
	}
}

// untilNATSLost returns ctx, cancelled too when nats.go closes the connection for good; the
// command then returns withNATSLost's error (wrapping errNATSClosed) rather than a clean stop.
func (c *conns) untilNATSLost(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	lost, _ := c.NATSLost()
	go func() {
		select {
		case <-lost:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

// withNATSLost returns err joined with why the NATS connection was lost, if it was.
func (c *conns) withNATSLost(err error) error {
	if _, why := c.NATSLost(); why() != nil {
		return errors.Join(why(), err)
	}
	return err
}

func (c *conns) Close() {
	c.closing.Store(true)
	if c.NC != nil {
		// Everything that used the connection has returned: close it before an embedded
		// server goes away under it.
		c.NC.Close()
	}
	if c.Pool != nil {
		closePool(c.Pool, poolCloseTimeout)
	}
	for i := len(c.cleanup) - 1; i >= 0; i-- {
		c.cleanup[i]()
	}
}

// poolCloseTimeout bounds the close of a command's PostgreSQL pool: pgxpool's Close waits for
// every connection in use to be returned (a status page request whose query hangs on a
// database that stopped answering) and gives each connection it closes up to 15 s. A command
// that exits leaves the rest to the operating system.
const poolCloseTimeout = 2 * time.Second

// closePool closes pool, waiting at most d.
func closePool(pool *pgxpool.Pool, d time.Duration) {
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		pool.Close()
	}()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-closed:
	case <-t.C:
	}
}

// runStopBound is the longest relay run takes to exit after SIGTERM with cfg (defaults for
// its unset fields), PostgreSQL or NATS not answering: the relay's stop
// (relay.Config.MaxStopTime), the close of the pool (poolCloseTimeout), stopSlack, and with
// tracing on the flush of the last spans (tracingShutdownTimeout, a collector not
// answering). A supervisor's grace period must be longer (deploy/: 30 s).
func runStopBound(cfg *relay.Config, tracing bool) time.Duration {
	d := cfg.MaxStopTime() + poolCloseTimeout + stopSlack
	if tracing {
		d += tracingShutdownTimeout
	}
	return d
}

// stopSlack is what relay run does after SIGTERM beyond the timers of runStopBound, which
// takes milliseconds: stopping the check-back, closing NATS, exiting.
const stopSlack = time.Second

// connectOptions say what a command needs.
type connectOptions struct {
	DSN      string
	NATSURL  string
	NeedNATS bool
	// NATSAuth are the NATS credentials and TLS options (natsAuth.options), already checked.
	NATSAuth []nats.Option
	// Embedded starts what is missing: a throwaway PostgreSQL cluster when DSN is empty (never
	// a database of a server already running), an in-process nats-server when NATSURL is
	// empty. Development only.
	Embedded bool
	Schema   string
	// Migrate applies migrations (embedded mode does so always).
	Migrate bool
	Log     *slog.Logger
	AppName string
	// Wait makes a daemon that starts while PostgreSQL or NATS does not answer wait for them
	// (saying so once, and in Waiting) instead of exiting; a failure waiting cannot fix ends it
	// all the same. A one-shot command does not wait: it fails at once, except that a NATS that
	// does not answer (but may) leaves NC connecting in the background and NATSDown set.
	Wait    bool
	Waiting *waitState
	// ConnectTimeout bounds each PostgreSQL connection attempt when the connection string
	// (connect_timeout) and PGCONNECT_TIMEOUT set none. Defaults to pgConnectTimeout.
	ConnectTimeout time.Duration
}

// connectTimeoutSet reports whether the connection string, or PGCONNECT_TIMEOUT (which pgx
// reads from the process's environment), sets connect_timeout: 0 there means "wait for ever",
// as in libpq, and is kept; pgx reads an absent one as 0 too.
func connectTimeoutSet(dsn string) bool {
	if os.Getenv("PGCONNECT_TIMEOUT") != "" {
		return true
	}
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		// The query alone: a multi-host URL (postgres://h1:5432,h2:5432/db) is no net/url URL.
		_, query, _ := strings.Cut(dsn, "?")
		q, err := url.ParseQuery(query)
		return err == nil && q.Has("connect_timeout")
	}
	_, ok := redact.KeyValues(dsn)["connect_timeout"]
	return ok
}

// pgConnectTimeout bounds a PostgreSQL connection attempt whose connection string sets no
// connect_timeout: pgx waits for ever by default, and a server that accepts the TCP
// connection and never answers (a half-open connection, a hung proxy) would hang a one-shot
// command (relay status, checkback --once) for ever. A daemon waiting at start tries again.
const pgConnectTimeout = 10 * time.Second

// The NATS connection's keepalive: see connect.
const (
	natsPingInterval = 2 * time.Second
	natsMaxPingsOut  = 2
)

func connect(ctx context.Context, o connectOptions) (*conns, error) {
	c := &conns{DSN: o.DSN, NATSURL: o.NATSURL, natsLost: make(chan struct{})}
	fail := func(err error) (*conns, error) { c.Close(); return nil, err }
	if o.Embedded && o.NeedNATS && c.DSN != "" && c.NATSURL == "" {
		// The other direction of "never a database nobody named": a named database's messages
		// published into a server that vanishes at exit (and deleted or marked published in
		// the database) would be lost.
		return nil, usageErr("--embedded with a database named (DATABASE_URL or --database-url) and no NATS: its outbox would be " +
			"published into a throwaway in-process nats-server and its messages lost at exit; set NATS_URL (or --nats-url), " +
			"or leave the database unset too for a throwaway PostgreSQL")
	}
	if c.DSN == "" {
		if !o.Embedded {
			return nil, usageErr("no database: set DATABASE_URL (or --database-url), or pass --embedded for local development")
		}
		// Never a database nobody named: not even a PostgreSQL that happens to run here.
		o.Log.Warn("embedded mode: starting a throwaway PostgreSQL cluster (deleted at exit, with everything in it); set --database-url and --nats-url, without --embedded, to keep data")
		pg, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{})
		if err != nil {
			return fail(err)
		}
		c.cleanup = append(c.cleanup, pg.Stop)
		c.DSN = pg.DSN()
		o.Migrate = true
	}
	// The connection string's secrets and key files are never shown: pgx's error quotes the
	// string (masking only the password) and the path it could not read (a PEM key pasted
	// into sslkey, say).
	if err := checkDSNFiles(c.DSN); err != nil {
		return fail(err)
	}
	pcfg, err := pgxpool.ParseConfig(c.DSN)
	if err != nil {
		return fail(usageErr("invalid DATABASE_URL (--database-url): %s", dsnError(c.DSN, err)))
	}
	if !connectTimeoutSet(c.DSN) {
		pcfg.ConnConfig.ConnectTimeout = cmp.Or(o.ConnectTimeout, pgConnectTimeout)
	}
	if o.AppName != "" {
		pcfg.ConnConfig.RuntimeParams["application_name"] = o.AppName
	}
	if _, set := pcfg.ConnConfig.RuntimeParams["jit"]; !set && !optionsSetJIT(pcfg.ConnConfig.RuntimeParams["options"]) {
		// Short statements only: JIT compilation (100-250 ms when a plan's estimated cost passes
		// jit_above_cost, easily reached on an outbox without statistics yet) would cost more
		// than any of them. The relay's claiming session sets it too (store.SetupRelaySession).
		// Set after connecting, not as a startup parameter: connection poolers such as
		// PgBouncer refuse startup parameters they do not know.
		after := pcfg.AfterConnect
		pcfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
			if after != nil {
				if err := after(ctx, conn); err != nil {
					return err
				}
			}
			_, err := conn.Exec(ctx, "SELECT set_config('jit', 'off', false)")
			return err
		}
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fail(fmt.Errorf("connect to PostgreSQL: %w", err))
	}
	c.Pool = pool
	if o.Migrate {
		m, err := migrations.New(&migrations.Config{Schema: o.Schema})
		if err != nil {
			return fail(err)
		}
		if _, err := m.Up(ctx, pool); err != nil {
			return fail(err)
		}
	}
	if !o.NeedNATS {
		return c, nil
	}
	if c.NATSURL == "" {
		if o.Embedded {
			o.Log.Info("embedded mode: starting an in-process nats-server with JetStream")
			srv, err := embedded.StartNATS(embedded.NATSOptions{})
			if err != nil {
				return fail(err)
			}
			c.cleanup = append(c.cleanup, srv.Shutdown)
			c.NATSURL = srv.URL()
		} else {
			c.NATSURL = DefaultNATSURL
		}
	}
	log := o.Log
	tlsFirst := false
	probe := nats.GetDefaultOptions()
	for _, opt := range o.NATSAuth {
		if opt(&probe) == nil && probe.TLSHandshakeFirst {
			tlsFirst = true
		}
	}
	opts := []nats.Option{
		nats.Name(o.AppName),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		// Publishes fail while the connection is down instead of waiting in a buffer to go out
		// late: the relay retries them itself, and may hand its partitions over meanwhile.
		nats.ReconnectBufSize(-1),
		// A connection whose server stopped answering without closing it (a network cut with
		// no reset: a routing change, a firewall, a NAT timeout) is taken for lost after
		// natsPingInterval × (natsMaxPingsOut + 1), 6 s, not nats.go's default 2 min × 3: the
		// relay's publishes would time out meanwhile while the connection looked up, and it
		// would keep its partitions instead of handing them over (--handover-after, 10 s).
		nats.PingInterval(natsPingInterval),
		nats.MaxPingsOutstanding(natsMaxPingsOut),
		// Every write to the socket checks that it carries no message handed to the client
		// under a partition lease that has ended since (a relay paused between the hand-off
		// and the client's write): see relay.WriteFence.
		nats.SetCustomDialer(relay.NewWriteFence(nil)),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			if natsAuthRefusal(err) {
				c.natsAuthErr.Store(&err)
			}
			subject := ""
			if sub != nil {
				subject = sub.Subject
			}
			log.Warn("nats error", "subject", subject, "err", err)
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info("nats reconnected", "server", nc.ConnectedUrlRedacted())
		}),
		// nats.go gives up reconnecting for good when a server refuses the credentials twice
		// in a row (a rotated password, an expired or revoked user JWT), or sends an error it
		// does not know (otherwise it reconnects for ever: MaxReconnects is -1): the command
		// that waits on NATSLost then ends, so that its supervisor restarts it, instead of
		// standing still and healthy.
		nats.ClosedHandler(func(nc *nats.Conn) {
			if c.lost(nc, tlsFirst) {
				log.Error("NATS closed the connection for good", "err", c.natsLostErr)
			}
		}),
	}
	opts = append(opts, o.NATSAuth...)
	// One connection attempt (to each server of the URL); once connected, the connection
	// reconnects by itself for ever.
	probed := false
	dial := func(more ...nats.Option) (*nats.Conn, error) {
		nc, err := nats.Connect(c.NATSURL, append(opts, more...)...)
		if err != nil {
			// A URL that does not parse comes back whole in the error: mask its credentials.
			if ue := (*url.Error)(nil); errors.As(err, &ue) {
				ue.URL = redact.NATS(ue.URL)
			}
			if !tlsFirst && !probed && silentServer(err) {
				// Once per command: a slow server is not sent a ClientHello at every retry.
				probed = true
				if u, nats := tlsFirstServer(ctx, c.NATSURL); u != "" {
					return nc, &tlsFirstError{url: u, nats: nats, err: err}
				}
			}
			err = natsHint(natsRefusedCause(c.NATSURL, err), tlsFirst)
		}
		return nc, err
	}
	if o.Wait {
		if err := waitReady(ctx, c, func() (*nats.Conn, error) { return dial() }, log, o.Waiting); err != nil {
			return fail(err)
		}
		return c, nil
	}
	nc, err := dial()
	switch {
	case err == nil:
	case !natsWaitable(err):
		return fail(&unfixableConnErr{what: "NATS", where: redact.NATS(c.NATSURL), err: err})
	default:
		// It may come: connect in the background, and let the command say what it could not do.
		log.Warn("NATS does not answer; going on without it for now", "at", redact.NATS(c.NATSURL), "err", err)
		c.NATSDown = err
		if nc, err = dial(nats.RetryOnFailedConnect(true)); err != nil {
			return fail(fmt.Errorf("connect to NATS: %w", err))
		}
	}
	c.NC = nc
	return c, nil
}

// natsRefusedCause adds to nats.go's ErrNoServers the network error behind it: nats.go
// reports a refused connection as "no servers available for connection" and drops the cause.
// One TCP dial to each server of urls (a comma-separated list; ws:// and wss:// servers are
// left out) tells what it was: the first failure is added, wrapped. Other errors come back as
// they are.
func natsRefusedCause(urls string, err error) error {
	if !errors.Is(err, nats.ErrNoServers) {
		return err
	}
	for _, u := range strings.Split(urls, ",") {
		u = strings.TrimSpace(u)
		if !strings.Contains(u, "://") {
			u = "nats://" + u // as nats.go takes it
		}
		p, perr := url.Parse(u)
		if perr != nil || p.Hostname() == "" || p.Scheme == "ws" || p.Scheme == "wss" {
			continue
		}
		port := p.Port()
		if port == "" {
			port = "4222"
		}
		conn, derr := net.DialTimeout("tcp", net.JoinHostPort(p.Hostname(), port), 2*time.Second)
		if derr != nil {
			return fmt.Errorf("%w: %w", err, derr)
		}
		_ = conn.Close()
	}
	return err
}

// natsHint adds to a refusal by NATS the settings that may fix it. tlsFirst says whether the
// connection starts with the TLS handshake (--nats-tls-first).
func natsHint(err error, tlsFirst bool) error {
	switch {
	case !tlsFirst && silentServer(err):
		// A server with handshake_first waits for the client's TLS handshake, the client for
		// the server's INFO, until one of them times out: EOF, or a read timeout.
		return fmt.Errorf("%w (the server did not speak first: if it wants the TLS handshake first (handshake_first), set --nats-tls-first)", err)
	case natsAuthRefusal(err):
		return fmt.Errorf("%w (check --nats-creds, --nats-nkey, --nats-user and --nats-password, or --nats-token)", err)
	case errors.Is(err, nats.ErrTLS), tlsRefusal(err):
		return fmt.Errorf("%w (the TLS handshake failed or the server closed the connection after it, as it does when it refuses a client certificate: check --nats-tls-ca, --nats-tls-cert and --nats-tls-key)", err)
	}
	return err
}

// tlsFirstError: a server of the URL answers a TLS handshake started at once, and the
// client waits for it to speak first: a configuration error, which waiting cannot fix. nats
// says whether it then spoke NATS (a nats-server with handshake_first, or a TLS-terminating
// proxy in front of one); else the URL names some other TLS service.
type tlsFirstError struct {
	url  string // redacted
	nats bool
	err  error
}

func (e *tlsFirstError) Error() string {
	if e.nats {
		return fmt.Sprintf("%s wants the TLS handshake first (handshake_first), and this client waits for the server to speak first: "+
			"set --nats-tls-first (TXOUTBOX_NATS_TLS_FIRST) (%v)", e.url, e.err)
	}
	return fmt.Sprintf("%s is not a NATS client port: it answers a TLS handshake at once, then says nothing a nats-server says "+
		"(an HTTPS or other TLS service? check the port) (%v)", e.url, e.err)
}

func (e *tlsFirstError) Unwrap() error { return e.err }

// tlsFirstServer tells a server that wants the TLS handshake first from one that is slow or
// hung, after a connection attempt found it silent (silentServer): it starts a TLS handshake
// with each server of urls in turn (a comma-separated list; ws:// and wss:// are left out),
// within tlsProbeTimeout in all and ctx, and returns the redacted URL of the first that
// answers it in TLS — a completed handshake, or a TLS alert (the server refusing a missing
// client certificate, say) — and whether it then sent a nats-server's INFO. The handshake
// skips verifying the server's certificate, since it only asks whether the server speaks TLS
// first, and nothing is sent over it. A plain server (slow or not) answers a ClientHello with
// no TLS record: "" then.
func tlsFirstServer(ctx context.Context, urls string) (string, bool) {
	ctx, cancel := context.WithTimeout(ctx, tlsProbeTimeout)
	defer cancel()
	for _, u := range strings.Split(urls, ",") {
		u = strings.TrimSpace(u)
		if !strings.Contains(u, "://") {
			u = "nats://" + u
		}
		p, err := url.Parse(u)
		if err != nil || p.Hostname() == "" || p.Scheme == "ws" || p.Scheme == "wss" {
			continue
		}
		port := p.Port()
		if port == "" {
			port = "4222"
		}
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort(p.Hostname(), port))
		if err != nil {
			continue
		}
		if dl, ok := ctx.Deadline(); ok {
			_ = conn.SetDeadline(dl)
		}
		tc := tls.Client(conn, &tls.Config{InsecureSkipVerify: true, ServerName: p.Hostname()})
		herr := tc.HandshakeContext(ctx)
		// A TLS alert (in TLS 1.3 a refused client certificate comes after the client's side of
		// the handshake, at the first read): a TLS server that wants a client certificate.
		alert := func(err error) bool {
			var op *net.OpError
			return errors.As(err, &op) && op.Op == "remote error"
		}
		switch {
		case herr == nil:
			// A nats-server speaks first once the handshake is done: its INFO.
			buf := make([]byte, len("INFO "))
			_, rerr := io.ReadFull(tc, buf)
			_ = conn.Close()
			return redact.NATS(u), alert(rerr) || (rerr == nil && string(buf) == "INFO ")
		case alert(herr):
			_ = conn.Close()
			return redact.NATS(u), true
		}
		_ = conn.Close()
	}
	return "", false
}

// tlsProbeTimeout bounds tlsFirstServer.
const tlsProbeTimeout = 3 * time.Second

// silentServer reports whether err is what a client that waits for the server's INFO gets
// from a server that waits for the client's TLS handshake: EOF (the server's TLS timeout
// closed the connection) or a read timeout (the client's came first).
func silentServer(err error) bool {
	var op *net.OpError
	return errors.Is(err, io.EOF) || (errors.As(err, &op) && op.Op == "read" && op.Timeout())
}

// natsAuthRefusal reports whether err is a server's refusal of the credentials.
func natsAuthRefusal(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrAuthRevoked) || errors.Is(err, nats.ErrAccountAuthExpired)
}

// tlsRefusal reports whether err is a TLS alert from the server or a certificate that does
// not verify.
func tlsRefusal(err error) bool {
	var op *net.OpError
	var alert tls.AlertError
	var verify *tls.CertificateVerificationError
	var unknown x509.UnknownAuthorityError
	var host x509.HostnameError
	return (errors.As(err, &op) && op.Op == "remote error") || errors.As(err, &alert) || errors.As(err, &verify) ||
		errors.As(err, &unknown) || errors.As(err, &host)
}

// checkNATSURL refuses, before anything connects, a NATS URL (or comma-separated list, as
// nats.go takes) that nats.go would take and never connect with: one that does not parse, an
// empty server, a scheme other than nats, tls, ws or wss (or websocket servers mixed with
// others), no host, a port out of range, a fragment, or a path or query on a server other than
// ws:// and wss:// (see checkNATSServer). The message masks its credentials.
func checkNATSURL(s string) error {
	var ws *bool // whether the servers so far are websocket servers
	for _, u := range strings.Split(s, ",") {
		u = strings.TrimSpace(u)
		if u == "" {
			return usageErr("invalid --nats-url %q: an empty server in the list", redact.NATS(s))
		}
		full := u
		if !strings.Contains(u, "://") {
			full = "nats://" + u
		}
		p, err := url.Parse(full)
		if err == nil {
			err = checkNATSServer(p)
		}
		if err == nil {
			isWS := p.Scheme == "ws" || p.Scheme == "wss"
			if ws != nil && *ws != isWS {
				err = errors.New("websocket (ws, wss) and other servers cannot be mixed")
			}
			ws = &isWS
		}
		if err != nil {
			if ue := (*url.Error)(nil); errors.As(err, &ue) {
				err = ue.Err
			}
			return usageErr("invalid --nats-url %q: %v", redact.NATS(u), err)
		}
	}
	return nil
}

func checkNATSServer(p *url.URL) error {
	switch p.Scheme {
	case "nats", "tls", "ws", "wss":
	default:
		return fmt.Errorf("scheme %q: want nats://, tls://, ws:// or wss://", p.Scheme)
	}
	if p.Opaque != "" || p.Hostname() == "" {
		return errors.New("no host")
	}
	if h := p.Hostname(); strings.Contains(h, ":") && !strings.HasPrefix(p.Host, "[") {
		// url.Parse takes the last ":…" as the port and leaves the rest in the host:
		// nats://host:4222:99 would be dialled as host "host:4222" for ever.
		return fmt.Errorf("host %q has a colon: a second port? (an IPv6 address goes in brackets: nats://[::1]:4222)", h)
	}
	if port := p.Port(); port != "" {
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return fmt.Errorf("port %s out of range", port)
		}
	}
	// nats.go sends a websocket URL's path and query in the HTTP upgrade request (a proxy
	// or load balancer may route on them: wss://host/nats); for nats:// and tls:// it
	// ignores them, so one there is a typo. No scheme ever uses a fragment.
	if p.Fragment != "" {
		return errors.New("a NATS URL has no fragment")
	}
	if ws := p.Scheme == "ws" || p.Scheme == "wss"; !ws && ((p.Path != "" && p.Path != "/") || p.RawQuery != "") {
		return fmt.Errorf("a %s:// URL has no path or query (only ws:// and wss:// do)", p.Scheme)
	}
	return nil
}

// checkSchema refuses to run against a schema that is not migrated to this binary's version.
func checkSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		return err
	}
	st, err := m.Status(ctx, pool)
	if err != nil {
		return fmt.Errorf("read the schema version: %w", err)
	}
	const nothing = "nothing: no version table of txoutbox, golang-migrate or goose in the schema"
	v, src := 0, nothing
	for _, s := range st {
		if s.Applied {
			v = s.Version
		}
		if s.Source != "" {
			src = s.Source
		}
	}
	if v == 0 && src == nothing {
		// No outbox at all: most likely the wrong schema (an outbox outside public, and a
		// command run without --schema), not one to create.
		return fmt.Errorf("schema %q has no outbox (read from %s): if the outbox is in another schema, give it with --schema "+
			"(or TXOUTBOX_SCHEMA); to create one here, %s", schema, src, upgradeAdvice(src, schema, v, m.Latest()))
	}
	if v < m.Latest() {
		return fmt.Errorf("schema %q is at migration version %d (read from %s) but this relay needs %d: %s", schema, v, src, m.Latest(), upgradeAdvice(src, schema, v, m.Latest()))
	}
	return nil
}

// upgradeAdvice says how to bring a schema up to date: with relay migrate up when txoutbox
// keeps its versions (or nothing does yet), else with the tool whose table src names
// (relay migrate up refuses a schema another tool manages: migrations.ErrManagedElsewhere).
func upgradeAdvice(src, schema string, v, latest int) string {
	switch {
	case strings.HasPrefix(src, migrations.HandAppliedSource):
		// No version table: relay migrate up leaves the schema to whoever applied it (it
		// refuses, migrations.ErrManagedElsewhere).
		which := fmt.Sprintf("migrations %d to %d", v+1, latest)
		if v+1 == latest {
			which = fmt.Sprintf("migration %d", latest)
		}
		return fmt.Sprintf("apply %s the way the earlier ones were applied (`relay migrate export --dir DIR` writes them; `relay migrate up` leaves a schema without a version table alone)", which)
	case strings.HasPrefix(src, "golang-migrate's "):
		return fmt.Sprintf("apply this binary's migrations/ with golang-migrate (`migrate -path migrations -database ... up`), which keeps %s (`relay migrate up` leaves such a schema to it)", src)
	case strings.HasPrefix(src, "goose's "):
		return fmt.Sprintf("apply this binary's migrations with goose (`relay migrate export --format goose`, then `goose ... up`), which keeps %s (`relay migrate up` leaves such a schema to it)", src)
	}
	return fmt.Sprintf("run `%s` (or apply migrations/ with your deploy tool)", cmdline.Command(schema, "relay migrate up"))
}

// optionsSetJIT reports whether a connection's options parameter sets jit itself
// ("-c jit=on", "-cjit=on", "--jit=on"); other settings that start with jit (jit_above_cost)
// do not count.
func optionsSetJIT(options string) bool {
	fields := strings.Fields(options)
	for i, f := range fields {
		switch {
		case f == "-c" && i+1 < len(fields):
			f = fields[i+1]
		case strings.HasPrefix(f, "-c"):
			f = f[2:]
		case strings.HasPrefix(f, "--"):
			f = f[2:]
		default:
			continue
		}
		if strings.HasPrefix(f, "jit=") {
			return true
		}
	}
	return false
}
