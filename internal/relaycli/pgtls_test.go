package relaycli

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// The relay reaches PostgreSQL over TLS set in the DSN (sslmode=verify-full, sslrootcert, and a
// client certificate) on a throwaway cluster with ssl=on that takes TCP connections over TLS
// with a client certificate only: relay migrate migrates, relay run publishes. A server
// certificate of another CA, no client certificate, or no TLS at all end relay run and relay
// checkback --once with exit status 1 and the reason, without waiting.
func TestRelayOverPostgresTLS(t *testing.T) {
	t.Parallel()
	if _, err := embedded.FindPostgresBinaries(); err != nil {
		t.Skipf("skipped: %v", err)
	}
	certs := testsvc.NewCerts(t, "postgres") // the client certificate's name is the user's
	other := testsvc.NewCerts(t, "postgres")
	ctx := context.Background()
	pg, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{TLS: &embedded.PostgresTLS{
		CertFile: certs.ServerCert, KeyFile: certs.ServerKey, CAFile: certs.CAFile, ClientCert: true}})
	if errors.Is(err, embedded.ErrNoPostgresBinaries) {
		t.Skipf("skipped: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Stop)
	dsn := func(q map[string]string) string {
		return withURL(t, pg.DSN(), func(u *url.URL) {
			v := url.Values{}
			for k, x := range q {
				v.Set(k, x)
			}
			u.RawQuery = v.Encode()
		})
	}
	good := dsn(map[string]string{"sslmode": "verify-full", "sslrootcert": certs.CAFile, "sslcert": certs.ClientCert, "sslkey": certs.ClientKey})

	code, out, errOut := cli(t, "migrate", "up", "--database-url", good)
	if code != 0 {
		t.Fatalf("migrate over TLS: exit %d\n%s%s", code, out, errOut)
	}
	conn, err := pgx.Connect(ctx, good)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var ssl bool
	if err := conn.QueryRow(ctx, `SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()`).Scan(&ssl); err != nil || !ssl {
		t.Fatalf("the test's connection is not over TLS (%v)", err)
	}
	client, err := outbox.NewClient(&outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		got, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Payload: []byte("over TLS")})
		for _, id := range got {
			ids = append(ids, id.String())
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}

	n := testsvc.NewNATS(t)
	n.Stream(t, "ORDERS", "orders.>")
	got := make(chan *nats.Msg, 4)
	if _, err := n.Conn.ChanSubscribe("orders.>", got); err != nil {
		t.Fatal(err)
	}
	if err := n.Conn.Flush(); err != nil {
		t.Fatal(err)
	}
	p := startRelay(t, "relay", "run", "--no-checkback", "--database-url", good, "--nats-url", n.URL(), "--log-format", "json")
	select {
	case m := <-got:
		if id := m.Header.Get("Nats-Msg-Id"); id != ids[0] {
			t.Errorf("published %q, want %s", id, ids[0])
		}
	case <-p.done:
		t.Fatalf("the relay exited:\n%s", p.output())
	case <-time.After(30 * time.Second):
		t.Fatalf("nothing published within 30s:\n%s", p.output())
	}
	// The relay's own sessions (its pool and its lease session) are over TLS too.
	var relaySessions, plain int
	if err := conn.QueryRow(ctx, `SELECT count(*) FILTER (WHERE a.application_name LIKE 'txoutbox-relay%'), count(*) FILTER (WHERE NOT s.ssl)
FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.client_addr IS NOT NULL`).Scan(&relaySessions, &plain); err != nil || relaySessions == 0 || plain != 0 {
		t.Errorf("%d relay sessions, %d sessions without TLS (%v); want some, and none", relaySessions, plain, err)
	}
	if code := p.stop(t, syscall.SIGTERM); code != 0 {
		t.Errorf("exit %d after SIGTERM, want 0:\n%s", code, p.output())
	}

	for _, c := range []struct {
		name string
		dsn  string
		want []string
	}{
		{"server certificate of another CA", dsn(map[string]string{"sslmode": "verify-full", "sslrootcert": other.CAFile, "sslcert": certs.ClientCert, "sslkey": certs.ClientKey}),
			[]string{"certificate signed by unknown authority"}},
		{"no client certificate", dsn(map[string]string{"sslmode": "verify-full", "sslrootcert": certs.CAFile}),
			[]string{"SQLSTATE 28000", "certificate"}},
		{"no TLS", dsn(map[string]string{"sslmode": "disable"}), []string{"SQLSTATE 28000", "no encryption"}},
	} {
		for _, cmd := range [][]string{{"run", "--no-checkback"}, {"checkback", "--once"}} {
			t.Run(c.name+"/"+cmd[0], func(t *testing.T) {
				t.Parallel()
				p := startRelay(t, "relay", append(cmd, "--database-url", c.dsn, "--nats-url", n.URL(), "--log-format", "json")...)
				if code := p.waitExit(t, 30*time.Second); code != 1 {
					t.Fatalf("exit %d, want 1:\n%s", code, p.output())
				}
				out := p.output()
				want := c.want
				if cmd[0] == "run" { // a daemon that would otherwise wait says why it does not
					want = append(want, "cannot connect to PostgreSQL", "waiting would not help")
				}
				for _, want := range want {
					if !strings.Contains(out, want) {
						t.Errorf("output lacks %q:\n%s", want, out)
					}
				}
			})
		}
	}
}
