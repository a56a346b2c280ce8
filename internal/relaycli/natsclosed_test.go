package relaycli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/redact"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// A relay (and a `relay checkback` daemon) whose NATS credentials stop working after it
// started (the password rotated on the server, which restarts on the same port with the new
// one) does not stand still for ever, healthy: nats.go closes the connection after the second
// refusal, and the process exits with status 1 and a message naming the refusal and the
// settings to check, so that its supervisor restarts it. The password never appears.
func TestRelayExitsWhenNATSRefusesItsCredentialsAfterStart(t *testing.T) {
	t.Parallel()
	for _, cmd := range [][]string{{"run", "--no-checkback"}, {"checkback"}} {
		t.Run(cmd[0], func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			const oldPw, newPw = "Nats-Old-Pw-31", "Nats-New-Pw-32"
			password := oldPw // read by the server's Configure at each start, from this goroutine
			srv := startAuthNATS(t, embedded.NATSOptions{Username: "relay", Password: oldPw,
				Configure: func(o *server.Options) { o.Password = password }})
			nc, err := nats.Connect(srv.URL(), nats.UserInfo("relay", oldPw))
			if err != nil {
				t.Fatal(err)
			}
			js, err := jetstream.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}}); err != nil {
				t.Fatal(err)
			}
			got := make(chan *nats.Msg, 4)
			if _, err := nc.ChanSubscribe("orders.>", got); err != nil {
				t.Fatal(err)
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			db := testsvc.NewDB(t)
			client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
			if err != nil {
				t.Fatal(err)
			}
			if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
				_, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Payload: []byte("before the rotation")})
				return err
			}); err != nil {
				t.Fatal(err)
			}
			p := startRelayEnv(t, "relay", []string{"TXOUTBOX_NATS_USER=relay", "TXOUTBOX_NATS_PASSWORD=" + oldPw},
				append(cmd, "--database-url", db.DSN, "--schema", db.Schema, "--nats-url", srv.URL(), "--log-format", "json")...)
			if cmd[0] == "run" {
				select { // connected: it published
				case <-got:
				case <-p.done:
					t.Fatalf("the relay exited:\n%s", p.output())
				case <-time.After(30 * time.Second):
					t.Fatalf("nothing published within 30s:\n%s", p.output())
				}
			} else {
				// Connected: the daemon starts the check-back only once its NATS connection is
				// up (a connection the server lists may still be in its handshake: under load
				// one such ended in EOF, and the daemon was still connecting at the rotation).
				p.waitLog(t, "check-back started", 30*time.Second)
			}
			nc.Close()

			// The password rotates: the server comes back on the same port with the new one.
			srv.Stop()
			password = newPw
			if err := srv.Start(); err != nil {
				t.Fatal(err)
			}
			if code := p.waitExit(t, 60*time.Second); code != 1 {
				t.Fatalf("exit %d after the rotation, want 1:\n%s", code, p.output())
			}
			out := p.output()
			for _, want := range []string{"NATS closed the connection for good", "Authorization Violation", "check --nats-creds", "supervisor restarts"} {
				if !strings.Contains(out, want) {
					t.Errorf("output lacks %q:\n%s", want, out)
				}
			}
			if strings.Contains(out, oldPw) {
				t.Errorf("the password is in the output:\n%s", out)
			}
		})
	}
}

// A relay without --nats-tls-first against a server that wants the TLS handshake first does
// not wait for it (it waited for ever, the server silent and the relay healthy): the silence
// is told from a slow server by a TLS handshake the server answers, and the relay exits 1
// saying to set --nats-tls-first.
func TestRelayWithoutTLSFirstExitsSayingSo(t *testing.T) {
	t.Parallel()
	certs := testsvc.NewCerts(t, "relay")
	srv := startAuthNATS(t, embedded.NATSOptions{TLS: certs.ServerTLS(t), TLSHandshakeFirst: true})
	db := testsvc.NewDB(t)
	p := startRelay(t, "relay", "run", "--no-checkback", "--database-url", db.DSN, "--schema", db.Schema,
		"--nats-url", fmt.Sprintf("tls://127.0.0.1:%d", srv.Port), "--nats-tls-ca", certs.CAFile,
		"--nats-tls-cert", certs.ClientCert, "--nats-tls-key", certs.ClientKey, "--log-format", "json")
	select {
	case <-p.done:
	case <-time.After(60 * time.Second):
		t.Fatalf("the relay still runs a minute after start:\n%s", p.output())
	}
	want := fmt.Sprintf("tls://127.0.0.1:%d wants the TLS handshake first (handshake_first), and this client waits for the server to speak first: set --nats-tls-first", srv.Port)
	if code := p.cmd.ProcessState.ExitCode(); code != 1 || !strings.Contains(p.output(), want) {
		t.Errorf("exit %d; want 1 saying %q:\n%s", code, want, p.output())
	}
	if n := len(p.find("waiting for NATS to answer")); n != 0 {
		t.Errorf("%d waiting lines, want none: waiting cannot fix this", n)
	}
}

// tlsFirstServer finds the server that answers a TLS handshake started at once, with or
// without a client certificate it wants (an alert is an answer in TLS), and says whether it
// then speaks NATS; it finds nothing at a plain server (it speaks first, in NATS) or a closed
// port, and tells an HTTPS server (TLS, then silence) from a nats-server.
func TestTLSFirstServer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	certs := testsvc.NewCerts(t, "relay")
	first := startAuthNATS(t, embedded.NATSOptions{TLS: certs.ServerTLS(t), TLSHandshakeFirst: true})
	plain := startAuthNATS(t, embedded.NATSOptions{})
	web := httptest.NewTLSServer(http.NotFoundHandler())
	defer web.Close()
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedURL := "nats://" + closed.Addr().String()
	_ = closed.Close()
	firstURL := fmt.Sprintf("tls://u:secret@127.0.0.1:%d", first.Port)
	firstRedacted := fmt.Sprintf("tls://u:xxxxx@127.0.0.1:%d", first.Port)
	webURL := "tls://" + web.Listener.Addr().String()
	for _, c := range []struct {
		urls, want string
		nats       bool
	}{
		{firstURL, firstRedacted, true},
		{fmt.Sprintf("nats://127.0.0.1:%d", plain.Port), "", false},
		{closedURL, "", false},
		{closedURL + "," + firstURL, firstRedacted, true},
		{webURL, webURL, false},
	} {
		if got, nats := tlsFirstServer(ctx, c.urls); got != c.want || nats != c.nats {
			t.Errorf("tlsFirstServer(%s) = %q, %v; want %q, %v", redact.NATS(c.urls), got, nats, c.want, c.nats)
		}
	}
	// A cancelled context probes nothing.
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if got, _ := tlsFirstServer(cancelled, firstURL); got != "" {
		t.Errorf("tlsFirstServer with a cancelled context = %q, want nothing", got)
	}
}

// natsHint adds the --nats-tls-first hint to what a client gets from a server that waits for
// its TLS handshake (EOF, a read timeout), and only then: not with --nats-tls-first set, not to
// a dial timeout or a refused connection.
func TestNATSHintTLSFirst(t *testing.T) {
	readTimeout := &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
	dialTimeout := &net.OpError{Op: "dial", Net: "tcp", Err: os.ErrDeadlineExceeded}
	for _, c := range []struct {
		err      error
		tlsFirst bool
		hint     bool
	}{
		{io.EOF, false, true},
		{fmt.Errorf("nats: %w", io.EOF), false, true},
		{readTimeout, false, true},
		{io.EOF, true, false},
		{readTimeout, true, false},
		{dialTimeout, false, false},
		{syscall.ECONNREFUSED, false, false},
	} {
		got := natsHint(c.err, c.tlsFirst)
		if strings.Contains(got.Error(), "--nats-tls-first") != c.hint {
			t.Errorf("natsHint(%v, tlsFirst %v) = %q, want the hint: %v", c.err, c.tlsFirst, got, c.hint)
		}
		if !errors.Is(got, c.err) {
			t.Errorf("natsHint(%v) = %v does not wrap it", c.err, got)
		}
	}
}

// The same for a credentials file whose user JWT expires while the relay runs: the server
// disconnects it ("User Authentication Expired") and refuses it after; the relay exits 1 with
// the refusal, to be restarted with a new file.
func TestRelayExitsWhenItsNATSUserJWTExpires(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	op := testsvc.NewOperator(t)
	srv := startAuthNATS(t, embedded.NATSOptions{Configure: op.Configure})
	nc, err := nats.Connect(srv.URL(), nats.UserCredentials(op.UserCreds("admin")))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}}); err != nil {
		t.Fatal(err)
	}
	got := make(chan *nats.Msg, 4)
	if _, err := nc.ChanSubscribe("orders.>", got); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	db := testsvc.NewDB(t)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Payload: []byte("before the expiry")})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// Long enough to start and publish on a loaded machine; the test then waits for the exit.
	creds := op.UserCredsExpiring("relay", time.Now().Add(15*time.Second))
	p := startRelay(t, "relay", "run", "--no-checkback", "--database-url", db.DSN, "--schema", db.Schema,
		"--nats-url", srv.URL(), "--nats-creds", creds, "--log-format", "json")
	select {
	case <-got:
	case <-p.done:
		t.Fatalf("the relay exited before publishing (did the JWT expire first?):\n%s", p.output())
	case <-time.After(30 * time.Second):
		t.Fatalf("nothing published within 30s:\n%s", p.output())
	}
	if code := p.waitExit(t, 60*time.Second); code != 1 {
		t.Fatalf("exit %d after the JWT expired, want 1:\n%s", code, p.output())
	}
	out := p.output()
	for _, want := range []string{"NATS closed the connection for good", "check --nats-creds"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}
