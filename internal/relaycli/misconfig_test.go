package relaycli

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// waitExit waits for the process to exit by itself and returns its exit status.
func (p *proc) waitExit(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
		return p.cmd.ProcessState.ExitCode()
	case <-time.After(timeout):
		t.Fatalf("%s still runs after %s, want it to exit:\n%s", p.name, timeout, p.output())
		return -1
	}
}

func randomSuffix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// withURL returns dsn (a URL) changed by edit.
func withURL(t *testing.T, dsn string, edit func(u *url.URL)) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil || u.Scheme == "" {
		t.Skipf("the test PostgreSQL's DSN is not a URL: %v", err)
	}
	edit(u)
	return u.String()
}

// A relay (and a check-back daemon) pointed at a PostgreSQL that answers but refuses it — a
// database or role that does not exist, a wrong password, a certificate that does not
// verify — exits 1 at once with the server's message instead of waiting for ever.
func TestMisconfiguredPostgresEndsWithTheServersMessage(t *testing.T) {
	t.Parallel()
	base := testsvc.PostgresDSN(t)
	n := testsvc.NewNATS(t)

	// The local server trusts connections on 127.0.0.1 (any password is accepted), so the
	// wrong password is tried on a throwaway cluster that asks for one (scram-sha-256).
	const password = "Right-Pw-4417"
	pg, err := embedded.StartPostgres(context.Background(), embedded.PostgresOptions{Password: password})
	if errors.Is(err, embedded.ErrNoPostgresBinaries) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Stop)
	if err := embedded.Ping(context.Background(), pg.DSN(), 10*time.Second); err != nil {
		t.Fatalf("the right password is refused: %v", err)
	}

	cases := []struct {
		name, dsn string
		want      []string // in the output
	}{
		{"no such database", withURL(t, base, func(u *url.URL) { u.Path = "/txoutbox_no_such_db_" + randomSuffix() }),
			[]string{"SQLSTATE 3D000", "txoutbox_no_such_db_"}},
		{"no such role", withURL(t, base, func(u *url.URL) { u.User = url.User("txoutbox_no_such_role_" + randomSuffix()) }),
			[]string{"SQLSTATE 28000", "txoutbox_no_such_role_"}},
		{"wrong password", withURL(t, pg.DSN(), func(u *url.URL) { u.User = url.UserPassword("postgres", "Wrong-Pw-9921") }),
			[]string{"SQLSTATE 28P01", "password authentication failed"}},
		// The server's certificate does not name 127.0.0.1 (or the server has no TLS at all):
		// either way no wait can fix it.
		{"certificate not verified", withURL(t, base, func(u *url.URL) {
			q := u.Query()
			q.Set("sslmode", "verify-full")
			u.RawQuery = q.Encode()
		}), nil},
	}
	for _, c := range cases {
		for _, cmd := range []string{"run", "checkback"} {
			t.Run(c.name+"/"+cmd, func(t *testing.T) {
				t.Parallel()
				args := []string{cmd, "--database-url", c.dsn, "--nats-url", n.URL(), "--log-format", "json"}
				if cmd == "run" {
					args = append(args, "--no-checkback")
				}
				p := startRelay(t, "relay-"+cmd, args...)
				if code := p.waitExit(t, 30*time.Second); code != 1 {
					t.Fatalf("exit %d, want 1:\n%s", code, p.output())
				}
				out := p.output()
				for _, want := range append([]string{"cannot connect to PostgreSQL", "waiting would not help"}, c.want...) {
					if !strings.Contains(out, want) {
						t.Errorf("output lacks %q:\n%s", want, out)
					}
				}
				if len(p.find("waiting for PostgreSQL to answer")) > 0 || strings.Contains(out, "Wrong-Pw-9921") {
					t.Errorf("it waited, or logged the password:\n%s", out)
				}
			})
		}
	}
}

// A PostgreSQL that does not answer is waited for: one warning (with the error), /healthz
// answers 200 from the start and /readyz 503 with what it waits for; SIGTERM ends the wait.
func TestUnreachablePostgresIsWaitedForAndReported(t *testing.T) {
	t.Parallel()
	n := testsvc.NewNATS(t)
	port, err := embedded.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable", port)
	for _, cmd := range []string{"run", "checkback"} {
		t.Run(cmd, func(t *testing.T) {
			t.Parallel()
			p := startRelay(t, "relay-"+cmd, cmd, "--database-url", dsn, "--nats-url", n.URL(),
				"--metrics-addr", "127.0.0.1:0", "--log-format", "json", "--log-level", "debug")
			addr, _ := p.waitLog(t, "serving metrics, health and the status page", 10*time.Second).Fields["addr"].(string)
			w := p.waitLog(t, "waiting for PostgreSQL to answer", 10*time.Second)
			if e, _ := w.Fields["err"].(string); e == "" || e == "<nil>" || !strings.Contains(e, "connection refused") {
				t.Errorf("the waiting line's err = %q, want the real error", e)
			}
			testsvc.Eventually(t, 20*time.Second, "three more attempts", func() bool { return len(p.find("still waiting for PostgreSQL")) >= 3 })
			if got := len(p.find("waiting for PostgreSQL to answer")); got != 1 {
				t.Errorf("%d waiting lines, want 1", got)
			}
			if body, code := testsvc.HTTPGet(t, "http://"+addr+"/healthz"); code != 200 {
				t.Errorf("/healthz while waiting = %d %q, want 200", code, body)
			}
			body, code := testsvc.HTTPGet(t, "http://"+addr+"/readyz")
			if code != 503 || !strings.Contains(body, "waiting for PostgreSQL: ") || !strings.Contains(body, "connection refused") {
				t.Errorf("/readyz while waiting = %d %q, want 503 with the reason", code, body)
			}
			if cmd == "run" {
				// The health gauge says starting (with no txoutbox series at all, an alert on
				// it could not fire for a relay that never gets going).
				body, _ := testsvc.HTTPGet(t, "http://"+addr+"/metrics")
				for _, want := range []string{`txoutbox_relay_health{state="starting"} 1`, `txoutbox_relay_health{state="ok"} 0`} {
					if !strings.Contains(body, want) {
						t.Errorf("/metrics while waiting lacks %q:\n%s", want, body)
					}
				}
			}
			if code := p.stop(t, syscall.SIGTERM); code != 0 {
				t.Errorf("exit %d after SIGTERM while waiting, want 0", code)
			}
		})
	}
}

// A NATS server that refuses the relay's credentials, or its TLS, ends relay run and the
// check-back (daemon and --once) with a message naming the problem.
func TestNATSRefusalEndsTheCommand(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	srv, err := embedded.StartNATS(embedded.NATSOptions{StoreDir: t.TempDir(), Username: "relay", Password: "Right-Pw-1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	good := fmt.Sprintf("nats://relay:Right-Pw-1@127.0.0.1:%d", srv.Port)
	nc, err := nats.Connect(good)
	if err != nil {
		t.Fatalf("the right credentials are refused: %v", err)
	}
	nc.Close()
	cases := []struct{ name, url, want string }{
		{"wrong password", fmt.Sprintf("nats://relay:Wrong-Pw-2@127.0.0.1:%d", srv.Port), "Authorization Violation"},
		{"no credentials", fmt.Sprintf("nats://127.0.0.1:%d", srv.Port), "Authorization Violation"},
		{"TLS the server does not offer", fmt.Sprintf("tls://relay:Right-Pw-1@127.0.0.1:%d", srv.Port), "secure connection not available"},
	}
	for _, c := range cases {
		for _, args := range [][]string{{"run", "--no-checkback"}, {"checkback"}, {"checkback", "--once"}} {
			t.Run(c.name+"/"+strings.Join(args, " "), func(t *testing.T) {
				t.Parallel()
				p := startRelay(t, "relay", append(args, "--database-url", db.DSN, "--schema", db.Schema, "--nats-url", c.url, "--log-format", "json")...)
				if code := p.waitExit(t, 30*time.Second); code != 1 {
					t.Fatalf("exit %d, want 1:\n%s", code, p.output())
				}
				out := p.output()
				for _, want := range []string{"cannot connect to NATS", "waiting would not help", c.want} {
					if !strings.Contains(out, want) {
						t.Errorf("output lacks %q:\n%s", want, out)
					}
				}
				if strings.Contains(out, "Wrong-Pw-2") || strings.Contains(out, "Right-Pw-1") {
					t.Errorf("a password is in the output:\n%s", out)
				}
			})
		}
	}
}

// The classification of connection failures, on the errors pgx and nats.go return: waiting
// helps a server that is unreachable, starting or full, never one that refused us.
func TestConnectFailureClassification(t *testing.T) {
	t.Parallel()
	pgErr := func(code string) error {
		return fmt.Errorf("connect: %w", errors.Join(fmt.Errorf("server error: %w", &pgconn.PgError{Severity: "FATAL", Code: code})))
	}
	for code, want := range map[string]bool{
		"28P01": false, "28000": false, "3D000": false, "42501": false, "0A000": false,
		"57P03": true, "53300": true, "57P01": true, "08006": true,
	} {
		if got := pgWaitable(pgErr(code)); got != want {
			t.Errorf("pgWaitable(SQLSTATE %s) = %v, want %v", code, got, want)
		}
	}
	// Two attempts (TLS, then plain; or two hosts): waiting helps if it helps either.
	if !pgWaitable(errors.Join(pgErr("28P01"), pgErr("57P03"))) || pgWaitable(errors.Join(pgErr("28P01"), pgErr("3D000"))) {
		t.Error("pgWaitable of joined attempts")
	}
	if pgWaitable(errors.New("something nobody knows")) {
		t.Error("an unknown failure is waited for")
	}
	for err, want := range map[error]bool{
		nats.ErrNoServers: true, nats.ErrTimeout: true, context.DeadlineExceeded: true,
		nats.ErrAuthorization: false, nats.ErrSecureConnWanted: false, nats.ErrSecureConnRequired: false,
		// A client certificate refused: the server closes the connection after the handshake.
		fmt.Errorf("%w: connection closed by remote after TLS handshake: %w", nats.ErrTLS, &net.OpError{Op: "write", Err: syscall.EPIPE}): false,
	} {
		if got := natsWaitable(fmt.Errorf("connect: %w", err)); got != want {
			t.Errorf("natsWaitable(%v) = %v, want %v", err, got, want)
		}
	}
}
