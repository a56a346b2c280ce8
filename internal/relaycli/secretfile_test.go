package relaycli

import (
	"errors"
	"net/url"
	"os"
	"strings"
	"testing"

	"github.com/nats-io/nkeys"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// A setting that holds a secret, or the path of a file holding one (or its certificate), is
// never echoed: given the secret itself (a seed pasted into TXOUTBOX_NATS_NKEY, a PEM key into
// --nats-tls-key or sslkey), a path that does not exist, or a file that is not what it should
// be, the command exits 2 naming the setting and saying why, and its output (stdout and
// stderr) holds no part of the value. NATS (flags and environment variables, relay run and
// relay checkback), PostgreSQL (the connection string's password, sslpassword, sslkey,
// sslcert, sslrootcert) and the OTLP exporter's certificates and headers.
func TestSecretSettingsAreNeverEchoed(t *testing.T) {
	t.Parallel()
	certs := testsvc.NewCerts(t, "relay")
	read := func(file string) string {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	keyPEM, certPEM := read(certs.ClientKey), read(certs.ClientCert)
	user, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	seed, err := user.Seed()
	if err != nil {
		t.Fatal(err)
	}
	// What must not appear: the value, and a line of a PEM block's body.
	fragments := func(v string) []string {
		out := []string{strings.TrimSpace(v)}
		for _, line := range strings.Split(v, "\n") {
			if len(line) > 20 && !strings.HasPrefix(line, "-----") {
				out = append(out, line)
				break
			}
		}
		return out
	}
	garbage := writeFile(t, "Garbage-File-Name-4.txt", "hello")
	values := []struct {
		name, value, why string
	}{
		{"seed", string(seed), "looks like an NKey seed"},
		{"private key", keyPEM, "looks like a PEM block"},
		{"certificate", certPEM, "looks like a PEM block"},
		{"jwt", "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.eyJzdWIiOiJVQUJDIn0.c2lnbmF0dXJl", "looks like a JWT"},
		{"missing path", "Not-A-Path-Secret-7f3a", "no such file"},
		{"wrong file", garbage, "invalid"},
	}
	type settingCase struct {
		flag  string
		extra []string // what goes with it
	}
	for _, sc := range []settingCase{
		{"nats-creds", nil},
		{"nats-nkey", nil},
		{"nats-tls-cert", []string{"--nats-tls-key", certs.ClientKey}},
		{"nats-tls-key", []string{"--nats-tls-cert", certs.ClientCert}},
		{"nats-tls-ca", nil},
	} {
		for _, v := range values {
			for _, cmd := range []string{"run", "checkback"} {
				for _, viaEnv := range []bool{false, true} {
					args := append([]string{cmd, "--database-url", "postgres://127.0.0.1:1/x"}, sc.extra...)
					vars := map[string]string{}
					if viaEnv {
						vars[envName(sc.flag)] = v.value
					} else {
						args = append(args, "--"+sc.flag, v.value)
					}
					code, stdout, stderr := cliEnv(t, vars, args...)
					out := stdout + stderr
					what := cmd + " --" + sc.flag + " " + v.name
					if viaEnv {
						what = cmd + " " + envName(sc.flag) + " " + v.name
					}
					if code != 2 || !strings.Contains(out, "--"+sc.flag) || !strings.Contains(out, v.why) {
						t.Errorf("%s: exit %d, %q; want 2 naming --%s and saying %q", what, code, out, sc.flag, v.why)
					}
					for _, f := range fragments(v.value) {
						if strings.Contains(out, f) {
							t.Errorf("%s: the value is echoed: %q", what, out)
						}
					}
				}
			}
		}
	}

	// PostgreSQL: the connection string's file parameters given the secret itself, and pgx's
	// own errors (a file it cannot read) without the string or its secrets.
	for _, c := range []struct {
		name, dsn string
		secrets   []string
		want      string
	}{
		{"url sslkey PEM", "postgres://127.0.0.1:1/x?sslmode=require&sslcert=/nonexistent/c.pem&sslkey=" + url.QueryEscape(keyPEM),
			fragments(keyPEM), "sslkey looks like a PEM block"},
		{"kv sslkey PEM", "host=127.0.0.1 port=1 sslmode=require sslcert=/nonexistent/c.pem sslkey='" + keyPEM + "'",
			fragments(keyPEM), "sslkey looks like a PEM block"},
		{"kv sslrootcert PEM", "host=127.0.0.1 port=1 sslmode=verify-full sslrootcert='" + certPEM + "'",
			fragments(certPEM), "sslrootcert looks like a PEM block"},
		{"kv missing files", "host=127.0.0.1 port=1 sslmode=require sslpassword=Ssl-Pw-Secret-91 sslcert=" + certs.ClientCert + " sslkey=/nonexistent/Key-Path-Secret-3",
			[]string{"Ssl-Pw-Secret-91", "Key-Path-Secret-3"}, "DATABASE_URL"},
		{"url missing root", "postgres://u:Url-Pw-Secret-77@127.0.0.1:1/x?sslmode=verify-full&sslpassword=Ssl-Pw-Secret-92&sslrootcert=/nonexistent/Root-Secret-5",
			[]string{"Url-Pw-Secret-77", "Ssl-Pw-Secret-92", "Root-Secret-5"}, "DATABASE_URL"},
	} {
		for _, cmd := range []string{"status", "run"} {
			code, stdout, stderr := cliEnv(t, map[string]string{"DATABASE_URL": c.dsn}, cmd)
			out := stdout + stderr
			if code != 2 || !strings.Contains(out, "DATABASE_URL") || !strings.Contains(strings.ReplaceAll(out, "the value of ", ""), c.want) {
				t.Errorf("%s %s: exit %d, %q; want 2 naming DATABASE_URL and %q", cmd, c.name, code, out, c.want)
			}
			for _, s := range c.secrets {
				if strings.Contains(out, s) {
					t.Errorf("%s %s: a secret is echoed: %q", cmd, c.name, out)
				}
			}
		}
	}

	// The OTLP exporter's certificate variables and headers.
	otlp := func(kv ...string) map[string]string {
		m := map[string]string{"DATABASE_URL": "postgres://127.0.0.1:1/x", "OTEL_TRACES_EXPORTER": "otlp"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	for _, c := range []struct {
		name    string
		vars    map[string]string
		setting string
		secrets []string
	}{
		{"CA PEM", otlp("OTEL_EXPORTER_OTLP_CERTIFICATE", certPEM), "OTEL_EXPORTER_OTLP_CERTIFICATE", fragments(certPEM)},
		{"CA missing", otlp("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/Ca-Secret-8"), "OTEL_EXPORTER_OTLP_CERTIFICATE", []string{"Ca-Secret-8"}},
		{"client key PEM", otlp("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", certs.ClientCert, "OTEL_EXPORTER_OTLP_CLIENT_KEY", keyPEM),
			"OTEL_EXPORTER_OTLP_CLIENT_KEY", fragments(keyPEM)},
		{"traces client key PEM", otlp("OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", certs.ClientCert, "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", keyPEM),
			"OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", fragments(keyPEM)},
		{"client key wrong", otlp("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", certs.ClientCert, "OTEL_EXPORTER_OTLP_CLIENT_KEY", garbage),
			"OTEL_EXPORTER_OTLP_CLIENT_KEY", []string{"Garbage-File-Name-4"}},
		{"headers", otlp("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer Hdr-Secret-1,broken"), "OTEL_EXPORTER_OTLP_HEADERS", []string{"Hdr-Secret-1"}},
	} {
		code, stdout, stderr := cliEnv(t, c.vars, "run")
		out := stdout + stderr
		if code != 2 || !strings.Contains(out, c.setting) {
			t.Errorf("run with %s: exit %d, %q; want 2 naming %s", c.name, code, out, c.setting)
		}
		for _, s := range c.secrets {
			if strings.Contains(out, s) {
				t.Errorf("run with %s: a secret is echoed: %q", c.name, out)
			}
		}
	}
}

// A short secret is not masked inside the library's text, where it may be one of the text's
// own words: the text is withheld whole. A long one is masked where it occurs.
func TestWithoutValuesShortSecretWithholdsTheText(t *testing.T) {
	t.Parallel()
	err := errors.New("failed to configure TLS (sslmode is invalid)")
	if got := withoutValues(err, "TLS"); strings.Contains(got, "TLS") || strings.Contains(got, "configure") {
		t.Errorf("short secret: %q, want the text withheld", got)
	}
	if got := withoutValues(err, "absent-secret"); got != err.Error() {
		t.Errorf("a secret not in the text: %q, want the text as it is", got)
	}
	long := errors.New("open s3cr3t-passw0rd: no such file")
	if got := withoutValues(long, "s3cr3t-passw0rd"); got != "open <value not shown>: no such file" {
		t.Errorf("long secret: %q", got)
	}
}
