package relaycli

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// natsAuthCase is a nats-server that wants credentials (or a client certificate), how the
// test connects to it, and the relay settings that connect.
type natsAuthCase struct {
	name   string
	srv    *embedded.NATS
	url    string
	admin  []nats.Option
	good   []string // relay settings that connect
	env    []string // environment of the good relay
	secret []string // must never be printed
	bad    []badNATSAuth
}

type badNATSAuth struct {
	name string
	args []string
	want string // in the output
}

func startAuthNATS(t *testing.T, opts embedded.NATSOptions) *embedded.NATS {
	t.Helper()
	opts.StoreDir = t.TempDir()
	srv, err := embedded.StartNATS(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// The relay connects to a nats-server that verifies client certificates (with TLS first or
// not), that wants a user and password, an NKey user, a token, or (operator mode) a user's
// credentials file, and publishes; a missing or wrong
// credential ends `relay run` and `relay checkback --once` with exit status 1 and the
// server's refusal, without waiting and without printing a secret.
func TestRelayPublishesOverAuthenticatedNATS(t *testing.T) {
	t.Parallel()
	certs := testsvc.NewCerts(t, "relay")
	other := testsvc.NewCerts(t, "relay") // another CA: its certificates are not trusted

	var cases []natsAuthCase
	{ // TLS with client certificate verification.
		srv := startAuthNATS(t, embedded.NATSOptions{TLS: certs.ServerTLS(t)})
		url := fmt.Sprintf("tls://127.0.0.1:%d", srv.Port)
		cases = append(cases, natsAuthCase{name: "tls client cert", srv: srv, url: url,
			admin: []nats.Option{nats.RootCAs(certs.CAFile), nats.ClientCert(certs.ClientCert, certs.ClientKey)},
			good:  []string{"--nats-tls-ca", certs.CAFile, "--nats-tls-cert", certs.ClientCert, "--nats-tls-key", certs.ClientKey},
			bad: []badNATSAuth{
				{"no client certificate", []string{"--nats-tls-ca", certs.CAFile}, "check --nats-tls-ca, --nats-tls-cert and --nats-tls-key"},
				{"client certificate of another CA", []string{"--nats-tls-ca", certs.CAFile, "--nats-tls-cert", other.ClientCert, "--nats-tls-key", other.ClientKey}, "check --nats-tls-ca, --nats-tls-cert and --nats-tls-key"},
				{"server certificate not trusted", []string{"--nats-tls-ca", other.CAFile, "--nats-tls-cert", certs.ClientCert, "--nats-tls-key", certs.ClientKey}, "certificate signed by unknown authority"},
			}})
	}
	{ // TLS handshake first.
		srv := startAuthNATS(t, embedded.NATSOptions{TLS: certs.ServerTLS(t), TLSHandshakeFirst: true})
		url := fmt.Sprintf("tls://127.0.0.1:%d", srv.Port)
		cases = append(cases, natsAuthCase{name: "tls first", srv: srv, url: url,
			admin: []nats.Option{nats.RootCAs(certs.CAFile), nats.ClientCert(certs.ClientCert, certs.ClientKey), nats.TLSHandshakeFirst()},
			good:  []string{"--nats-tls-first", "--nats-tls-ca", certs.CAFile, "--nats-tls-cert", certs.ClientCert, "--nats-tls-key", certs.ClientKey}})
	}
	{ // User and password, given in the environment.
		srv := startAuthNATS(t, embedded.NATSOptions{Username: "relay", Password: "Nats-Right-Pw-71"})
		cases = append(cases, natsAuthCase{name: "user password", srv: srv, url: srv.URL(),
			admin:  []nats.Option{nats.UserInfo("relay", "Nats-Right-Pw-71")},
			env:    []string{"TXOUTBOX_NATS_USER=relay", "TXOUTBOX_NATS_PASSWORD=Nats-Right-Pw-71"},
			secret: []string{"Nats-Right-Pw-71", "Nats-Wrong-Pw-72"},
			bad: []badNATSAuth{
				{"wrong password", []string{"--nats-user", "relay", "--nats-password", "Nats-Wrong-Pw-72"}, "Authorization Violation (check --nats-creds"},
				{"no credentials", nil, "Authorization Violation"},
			}})
	}
	{ // User and password in a URL without a scheme (nats.go takes it as nats://): masked too.
		srv := startAuthNATS(t, embedded.NATSOptions{Username: "relay", Password: "Nats-Right-Pw-73"})
		cases = append(cases, natsAuthCase{name: "user password in a URL without a scheme", srv: srv,
			url:    fmt.Sprintf("relay:Nats-Right-Pw-73@127.0.0.1:%d", srv.Port),
			admin:  []nats.Option{nats.UserInfo("relay", "Nats-Right-Pw-73")},
			secret: []string{"Nats-Right-Pw-73", "Nats-Wrong-Pw-74"},
			bad: []badNATSAuth{
				{"wrong password", []string{"--nats-url", fmt.Sprintf("relay:Nats-Wrong-Pw-74@127.0.0.1:%d", srv.Port)}, "Authorization Violation (check --nats-creds"},
			}})
	}
	{ // An NKey user.
		user, err := nkeys.CreateUser()
		if err != nil {
			t.Fatal(err)
		}
		pub, _ := user.PublicKey()
		seed, _ := user.Seed()
		stranger, _ := nkeys.CreateUser()
		strangerSeed, _ := stranger.Seed()
		seedFile := writeFile(t, "relay.nk", string(seed))
		strangerFile := writeFile(t, "stranger.nk", string(strangerSeed))
		srv := startAuthNATS(t, embedded.NATSOptions{NKeys: []string{pub}})
		adminOpt, err := nats.NkeyOptionFromSeed(seedFile)
		if err != nil {
			t.Fatal(err)
		}
		cases = append(cases, natsAuthCase{name: "nkey", srv: srv, url: srv.URL(), admin: []nats.Option{adminOpt},
			good:   []string{"--nats-nkey", seedFile},
			secret: []string{string(seed), string(strangerSeed)},
			bad: []badNATSAuth{
				{"unknown nkey", []string{"--nats-nkey", strangerFile}, "Authorization Violation"},
				{"no credentials", nil, "Authorization Violation"},
			}})
	}

	{ // A token, given in the environment.
		srv := startAuthNATS(t, embedded.NATSOptions{Token: "Nats-Token-81"})
		cases = append(cases, natsAuthCase{name: "token", srv: srv, url: srv.URL(),
			admin:  []nats.Option{nats.Token("Nats-Token-81")},
			env:    []string{"TXOUTBOX_NATS_TOKEN=Nats-Token-81"},
			secret: []string{"Nats-Token-81", "Nats-Token-82"},
			bad: []badNATSAuth{
				{"wrong token", []string{"--nats-token", "Nats-Token-82"}, "Authorization Violation"},
			}})
	}
	{ // Operator mode: a user JWT and seed in a credentials file, as nsc writes it.
		op := testsvc.NewOperator(t)
		stranger := testsvc.NewOperator(t) // its users are not trusted
		srv := startAuthNATS(t, embedded.NATSOptions{Configure: op.Configure})
		creds := op.UserCreds("relay")
		cases = append(cases, natsAuthCase{name: "credentials file", srv: srv, url: srv.URL(),
			admin: []nats.Option{nats.UserCredentials(op.UserCreds("admin"))},
			good:  []string{"--nats-creds", creds},
			bad: []badNATSAuth{
				{"user of another operator", []string{"--nats-creds", stranger.UserCreds("relay")}, "Authorization Violation"},
				{"no credentials", nil, "Authorization Violation"},
			}})
	}

	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			nc, err := nats.Connect(c.url, c.admin...)
			if err != nil {
				t.Fatalf("the test's own connection is refused: %v", err)
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
			var ids []string
			if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
				got, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Payload: []byte("over " + c.name)})
				for _, id := range got {
					ids = append(ids, id.String())
				}
				return err
			}); err != nil {
				t.Fatal(err)
			}
			base := []string{"--database-url", db.DSN, "--schema", db.Schema, "--nats-url", c.url, "--log-format", "json"}
			p := startRelayEnv(t, "relay", c.env, append(append([]string{"run", "--no-checkback"}, base...), c.good...)...)
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
			if code := p.stop(t, syscall.SIGTERM); code != 0 {
				t.Errorf("exit %d after SIGTERM, want 0:\n%s", code, p.output())
			}
			for _, s := range c.secret {
				if strings.Contains(p.output(), s) {
					t.Errorf("a secret is in the output:\n%s", p.output())
				}
			}

			for _, b := range c.bad {
				for _, cmd := range [][]string{{"run", "--no-checkback"}, {"checkback", "--once"}} {
					t.Run(b.name+"/"+cmd[0], func(t *testing.T) {
						t.Parallel()
						p := startRelay(t, "relay", append(append(cmd, base...), b.args...)...)
						if code := p.waitExit(t, 30*time.Second); code != 1 {
							t.Fatalf("exit %d, want 1:\n%s", code, p.output())
						}
						out := p.output()
						for _, want := range []string{"cannot connect to NATS", "waiting would not help", b.want} {
							if !strings.Contains(out, want) {
								t.Errorf("output lacks %q:\n%s", want, out)
							}
						}
						for _, s := range c.secret {
							if strings.Contains(out, s) {
								t.Errorf("a secret is in the output:\n%s", out)
							}
						}
					})
				}
			}
		})
	}
}

// NATS credentials and TLS settings that cannot work are refused before anything connects
// (exit status 2, naming the setting); --help never shows a secret set in the environment.
func TestNATSAuthSettingsAreChecked(t *testing.T) {
	t.Parallel()
	certs := testsvc.NewCerts(t, "relay")
	notASeed := writeFile(t, "not-a-seed", "hello")
	// Credentials files that exist but are not credentials files: nats.go would read them only
	// at connect. One that is not one at all, a user JWT without its seed, a seed with a JWT
	// that does not decode.
	good, err := os.ReadFile(testsvc.NewOperator(t).UserCreds("relay"))
	if err != nil {
		t.Fatal(err)
	}
	jwtPart, seedPart, ok := strings.Cut(string(good), "************************* IMPORTANT *************************")
	if !ok {
		t.Fatalf("credentials file without its usual layout:\n%s", good)
	}
	garbageCreds := writeFile(t, "garbage.creds", "hello\n")
	jwtOnly := writeFile(t, "jwt-only.creds", jwtPart)
	_, seedBlock, _ := strings.Cut(seedPart, "-----BEGIN USER NKEY SEED-----")
	badJWT := writeFile(t, "bad-jwt.creds", "-----BEGIN NATS USER JWT-----\nnot.a.jwt\n------END NATS USER JWT------\n\n-----BEGIN USER NKEY SEED-----"+seedBlock)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--nats-tls-cert", certs.ClientCert}, "--nats-tls-cert and --nats-tls-key go together"},
		{[]string{"--nats-tls-cert", certs.ClientCert, "--nats-tls-key", certs.ServerKey}, "private key does not match"},
		{[]string{"--nats-tls-ca", filepath.Join(certs.Dir, "missing.pem")}, "--nats-tls-ca (TXOUTBOX_NATS_TLS_CA): no such file"}, // the path is not shown
		{[]string{"--nats-nkey", notASeed}, "invalid --nats-nkey"},
		{[]string{"--nats-creds", filepath.Join(certs.Dir, "missing.creds")}, "invalid --nats-creds"},
		{[]string{"--nats-creds", garbageCreds}, "invalid --nats-creds"},
		{[]string{"--nats-creds", jwtOnly}, "invalid --nats-creds"},
		{[]string{"--nats-creds", badJWT}, "invalid --nats-creds"},
		{[]string{"--nats-token", "t", "--nats-user", "u"}, "set one of"},
		// Credentials in the URL are a method too.
		{[]string{"--nats-url", "nats://u:Url-Pw-1@127.0.0.1:4222", "--nats-token", "t"}, "--nats-url carries credentials"},
		{[]string{"--nats-url", "nats://Url-Token-1@127.0.0.1:4222", "--nats-user", "u", "--nats-password", "p"}, "--nats-url carries credentials"},
		{[]string{"--nats-url", "nats://127.0.0.1:4222,nats://u:Url-Pw-1@127.0.0.1:4223", "--nats-creds", garbageCreds}, "--nats-url carries credentials"},
		{[]string{"--nats-url", "nats://u:Url-Pw-1@127.0.0.1:4222", "--nats-nkey", notASeed}, "--nats-url carries credentials"},
		{[]string{"--nats-password", "p"}, "--nats-password needs --nats-user"},
	} {
		for _, cmd := range []string{"run", "checkback"} {
			args := append([]string{cmd, "--database-url", "postgres://127.0.0.1:1/x"}, c.args...)
			code, _, stderr := cliEnv(t, nil, args...)
			if code != 2 || !strings.Contains(stderr, c.want) {
				t.Errorf("%v: exit %d, %q; want 2 and %q", args, code, stderr, c.want)
			}
			if strings.Contains(stderr, "Url-Pw-1") || strings.Contains(stderr, "Url-Token-1") {
				t.Errorf("%v: a secret of the URL is in the message: %q", args, stderr)
			}
		}
	}
	vars := map[string]string{"TXOUTBOX_NATS_PASSWORD": "Help-Secret-1", "TXOUTBOX_NATS_TOKEN": "Help-Secret-2"}
	for _, cmd := range []string{"run", "checkback"} {
		code, stdout, _ := cliEnv(t, vars, cmd, "--help")
		if code != 0 || strings.Contains(stdout, "Help-Secret") {
			t.Errorf("%s --help: exit %d, or shows a secret:\n%s", cmd, code, stdout)
		}
		for _, want := range []string{"--nats-creds", "TXOUTBOX_NATS_CREDS", "--nats-nkey", "--nats-password", "TXOUTBOX_NATS_PASSWORD", "--nats-tls-first"} {
			if !strings.Contains(stdout, want) {
				t.Errorf("%s --help lacks %s", cmd, want)
			}
		}
	}
}
