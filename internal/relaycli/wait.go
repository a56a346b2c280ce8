package relaycli

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/backoff"
	"github.com/txoutbox/txoutbox/internal/redact"
	"github.com/txoutbox/txoutbox/relay"
)

// A daemon started while PostgreSQL or NATS does not answer waits for it: the server may be
// starting, restarting or out of reach for a moment. A failure that waiting cannot fix — the
// server answered and refused (authentication, a database or role that does not exist, no
// CONNECT privilege), TLS refused or a certificate that does not verify, a server that is not
// what the URL says — ends the command with the server's message instead.
//
// Classification reads error types and SQLSTATE codes, never messages. Where one attempt
// tried several hosts (or TLS, then plain), waiting helps if it may help any of them.

// pgWaitable reports whether a failure to connect to PostgreSQL may go away by waiting.
func pgWaitable(err error) bool { return waitable(err, pgNode) }

// natsWaitable reports whether a failure to connect to NATS may go away by waiting. A TLS
// failure (nats.ErrTLS: the handshake failed, or the server closed the connection right after
// it, as a server does that refuses our client certificate) is not: nats.go wraps it together
// with the network error it saw, which alone would look passing.
func natsWaitable(err error) bool {
	var tf *tlsFirstError
	if errors.Is(err, nats.ErrTLS) || errors.As(err, &tf) {
		return false
	}
	return waitable(err, natsNode)
}

// waitable walks err's tree: the first node that node decides about decides, and a node with
// several wrapped errors is waitable when any of them is. An error nothing decides about is
// not waited for.
func waitable(err error, node func(error) (decided, wait bool)) bool {
	for err != nil {
		if multi, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range multi.Unwrap() {
				if waitable(e, node) {
					return true
				}
			}
			return false
		}
		if decided, wait := node(err); decided {
			return wait
		}
		err = errors.Unwrap(err)
	}
	return false
}

// pgWaitableCodes are the SQLSTATEs, at connect, of a server that may accept us later:
// connection exceptions, insufficient resources (53300 too_many_connections included: other
// sessions end, and a relay that exits would only come back to the same queue), and a server
// shutting down, crashed or starting (57P01, 57P02, 57P03 cannot_connect_now).
func pgCodeWaitable(code string) bool {
	switch code {
	case "08000", "08001", "08003", "08006", "57P01", "57P02", "57P03", "57014":
		return true
	}
	return len(code) == 5 && code[:2] == "53"
}

func pgNode(err error) (decided, wait bool) {
	switch e := err.(type) {
	case *pgconn.PgError:
		return true, pgCodeWaitable(e.Code)
	case *pgconn.ParseConfigError:
		return true, false
	}
	return netNode(err)
}

func natsNode(err error) (decided, wait bool) {
	for _, e := range []error{nats.ErrNoServers, nats.ErrTimeout, nats.ErrStaleConnection,
		nats.ErrMaxConnectionsExceeded, nats.ErrMaxAccountConnectionsExceeded} {
		if err == e {
			return true, true
		}
	}
	return netNode(err)
}

// netNode decides about the errors of the network and of TLS, the same for both servers.
func netNode(err error) (decided, wait bool) {
	switch e := err.(type) {
	case *tls.CertificateVerificationError, x509.UnknownAuthorityError, x509.HostnameError,
		x509.CertificateInvalidError, x509.SystemRootsError, tls.RecordHeaderError, tls.AlertError, *tls.ECHRejectionError:
		return true, false
	case *net.OpError:
		// A TLS alert from the server (it refused our certificate, or our TLS) comes as a
		// "remote error"; any other operation failed on the network.
		if e.Op == "remote error" {
			return true, false
		}
		if e.Err != nil {
			if decided, wait := netNode(e.Err); decided && !wait {
				return true, false
			}
		}
		return true, true
	case *net.DNSError, *net.AddrError, syscall.Errno:
		return true, true
	}
	switch {
	case err == io.EOF, err == io.ErrUnexpectedEOF, err == context.DeadlineExceeded, err == context.Canceled:
		return true, true
	}
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		return true, true
	}
	return false, false
}

// unfixableConnErr is a connection failure waiting cannot fix (exit status 1).
type unfixableConnErr struct {
	what, where string
	err         error
}

func (e *unfixableConnErr) Error() string {
	return fmt.Sprintf("cannot connect to %s at %s, and waiting would not help: %v", e.what, e.where, e.err)
}

func (e *unfixableConnErr) Unwrap() error { return e.err }

// waitState is what a command waits for, for /readyz and the status page while it does.
type waitState struct {
	mu     sync.Mutex
	reason string
}

func (w *waitState) set(reason string) {
	if w == nil {
		return
	}
	w.mu.Lock()
	w.reason = reason
	w.mu.Unlock()
}

func (w *waitState) get() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.reason
}

// errStoppedWaiting is returned when the command is stopped (ctx ends) while it waits for its
// dependencies: a clean stop, exit status 0.
var errStoppedWaiting = errors.New("stopped while waiting for PostgreSQL and NATS")

// waitReady waits until PostgreSQL answers a ping and, when dial is set, NATS accepts a
// connection (dial's; c.NC is set to it), or ctx ends. Each round tries both that have not
// answered yet, so that a failure waiting cannot fix is seen at once on either side: it ends
// the wait with an *unfixableConnErr. It logs one warning per dependency it waits for (with
// the error), and one line when both answer; st says what it waits for meanwhile.
func waitReady(ctx context.Context, c *conns, dial func() (*nats.Conn, error), log *slog.Logger, st *waitState) error {
	waited := map[string]bool{}
	pgUp := false
	for pass := 1; ; pass++ {
		var reasons []string
		wait := func(what, where string, err error) {
			reasons = append(reasons, "waiting for "+what+": "+err.Error())
			if !waited[what] {
				waited[what] = true
				log.Warn("waiting for "+what+" to answer", "at", where, "err", err)
			} else {
				log.Debug("still waiting for "+what, "at", where, "err", err)
			}
		}
		if !pgUp {
			pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			err := c.Pool.Ping(pctx)
			cancel()
			switch {
			case ctx.Err() != nil:
				return errStoppedWaiting
			case err == nil:
				pgUp = true
			case !pgWaitable(err):
				return &unfixableConnErr{what: "PostgreSQL", where: redact.DSN(c.DSN), err: err}
			default:
				wait("PostgreSQL", redact.DSN(c.DSN), err)
			}
		}
		if c.NC == nil && dial != nil {
			nc, err := dial()
			switch {
			case ctx.Err() != nil:
				if nc != nil {
					c.closing.Store(true) // our close, not one to report
					nc.Close()
				}
				return errStoppedWaiting
			case err == nil:
				c.NC = nc
			case !natsWaitable(err):
				return &unfixableConnErr{what: "NATS", where: redact.NATS(c.NATSURL), err: err}
			default:
				wait("NATS", redact.NATS(c.NATSURL), err)
			}
		}
		if len(reasons) == 0 {
			st.set("")
			if len(waited) > 0 {
				log.Info("PostgreSQL and NATS answer; starting")
			}
			return nil
		}
		st.set(strings.Join(reasons, "\n"))
		t := time.NewTimer(waitDelay(pass))
		select {
		case <-ctx.Done():
			t.Stop()
			return errStoppedWaiting
		case <-t.C:
		}
	}
}

// waitJitter spreads the rounds of waitReady, which comes before any component's Config
// (daemons started together, by one deploy, do not ask the servers together): the relay's
// default jitter.
const waitJitter = relay.DefaultBackoffJitter

// waitDelay is the wait after the pass-th round of waitReady that found a dependency not
// answering: 100ms doubling up to 2s, jittered (the one backoff every component uses).
func waitDelay(pass int) time.Duration {
	return backoff.Exponential(pass, 100*time.Millisecond, 2*time.Second, waitJitter)
}
