package relaycli

import (
	"errors"
	"io/fs"
	"net/url"
	"os"
	"regexp"
	"strings"

	"github.com/txoutbox/txoutbox/internal/redact"
)

// Settings that name a file holding secret material (an NKey seed, a credentials file, a
// private key) or the certificates that go with it: --nats-creds, --nats-nkey,
// --nats-tls-cert, --nats-tls-key, --nats-tls-ca, the OTLP exporter's certificate variables,
// and sslkey, sslcert and sslrootcert of DATABASE_URL. An operator may put the secret itself
// where its path goes (a seed pasted into TXOUTBOX_NATS_NKEY, a PEM key into a variable): the
// errors about such a setting name it and say why, never its value.

// secretLike says what a value looks like when it is secret material rather than a file's
// path ("" when it may be a path): a PEM block, the contents of a file (line breaks), an NKey
// seed or a JWT.
func secretLike(v string) string {
	t := strings.TrimSpace(v)
	switch {
	case strings.Contains(v, "-----BEGIN") || strings.Contains(v, "-----END"):
		return "a PEM block (a key or a certificate)"
	case strings.ContainsAny(v, "\r\n"):
		return "the contents of a file (it has line breaks)"
	case nkeySeed.MatchString(t):
		return "an NKey seed"
	case jwtLike.MatchString(t):
		return "a JWT"
	}
	return ""
}

var (
	// An NKey seed: S, then its type, in base32 (SU... for a user), 58 characters.
	nkeySeed = regexp.MustCompile(`^S[A-Z2-7]{40,}$`)
	jwtLike  = regexp.MustCompile(`^eyJ[A-Za-z0-9_-]*\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*$`)
)

// checkSecretFile checks the value of a setting (named so in errors: "--nats-nkey
// (TXOUTBOX_NATS_NKEY)") that must be the path of a readable file: a usage error (exit status
// 2) says why it is not — it looks like the secret itself, no such file, not a readable file —
// and never shows the value.
func checkSecretFile(setting, path string) error {
	if what := secretLike(path); what != "" {
		return usageErr("invalid %s: its value looks like %s, not a path: mount it as a file and give its path (the value is not shown)", setting, what)
	}
	fi, err := os.Stat(path)
	if err == nil && fi.IsDir() {
		return usageErr("invalid %s: not a readable file: a directory (the value is not shown)", setting)
	}
	if err == nil {
		var f *os.File
		if f, err = os.Open(path); err == nil {
			return f.Close()
		}
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return usageErr("invalid %s: no such file (the value is not shown)", setting)
	case errors.Is(err, fs.ErrPermission):
		return usageErr("invalid %s: not a readable file: permission denied (the value is not shown)", setting)
	}
	return usageErr("invalid %s: not a readable file: %s (the value is not shown)", setting, pathErrReason(err))
}

// pathErrReason is why a file operation failed, without the path.
func pathErrReason(err error) string {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err.Error()
	}
	return "cannot open it"
}

// withoutValues returns err's text with every non-empty value of values replaced by a mask:
// for the errors of a library (nats.go, pgx) about a setting whose value must not be shown.
// A value shorter than minMasked bytes that occurs in the text may be one of the text's own
// words (a password "TLS" in "failed to configure TLS"): masking it would both garble the
// text and show where, and what, the value is. The whole text is withheld instead.
func withoutValues(err error, values ...string) string {
	s := err.Error()
	for _, v := range values {
		v = strings.TrimSpace(v)
		if v == "" || !strings.Contains(s, v) {
			continue
		}
		if len(v) < minMasked {
			return "the library's error is not shown: it holds a value that must not be shown"
		}
		s = strings.ReplaceAll(s, v, "<value not shown>")
	}
	return s
}

// minMasked is the shortest secret withoutValues masks in place.
const minMasked = 8

// settingName names a setting that is a flag and an environment variable, as errors do.
func settingName(flag string) string {
	return "--" + flag + " (" + envName(flag) + ")"
}

// dsnSecretParams are the connection parameters whose values a message about a connection
// string never shows: the secrets and the files that hold them (or their certificates).
var dsnSecretParams = []string{"password", "sslpassword", "sslkey", "sslcert", "sslrootcert", "passfile"}

// dsnFileParams are the parameters that name a file (libpq's environment variables for them,
// which pgx reads too).
var dsnFileParams = map[string]string{"sslkey": "PGSSLKEY", "sslcert": "PGSSLCERT", "sslrootcert": "PGSSLROOTCERT"}

// dsnParams returns the parameters of a PostgreSQL connection string, a URL
// (postgres://user:password@host/db?sslkey=...) or libpq key=value pairs, as far as they can
// be read: the password of a URL's userinfo is "password". Both the raw and the decoded form
// of a URL's values are returned (decoded under the name, raw under name+" raw").
func dsnParams(dsn string) map[string]string {
	p := map[string]string{}
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		if u, err := url.Parse(dsn); err == nil {
			if pw, ok := u.User.Password(); ok {
				p["password"] = pw
			}
			for k, vs := range u.Query() {
				if len(vs) > 0 {
					p[k] = vs[0]
				}
			}
		}
		// A URL that does not parse (a PEM block in a query value does not): read the query by
		// hand, raw.
		if _, q, ok := strings.Cut(dsn, "?"); ok {
			for _, kv := range strings.Split(q, "&") {
				if k, v, ok := strings.Cut(kv, "="); ok {
					p[k+" raw"] = v
					if d, err := url.QueryUnescape(v); err == nil && p[k] == "" {
						p[k] = d
					}
				}
			}
		}
		return p
	}
	return redact.KeyValues(dsn)
}

// checkDSNFiles refuses (a usage error naming the parameter) an sslkey, sslcert or
// sslrootcert of dsn, or of libpq's environment variable for it, that holds secret material
// itself rather than a file's path. Whether the file exists is left to pgx, which has its own
// rules (sslrootcert=system, sslcertmode=disable); its errors go through dsnError.
func checkDSNFiles(dsn string) error {
	p := dsnParams(dsn)
	for _, k := range []string{"sslkey", "sslcert", "sslrootcert"} {
		for _, v := range []string{p[k], p[k+" raw"]} {
			if what := secretLike(v); what != "" {
				return usageErr("invalid DATABASE_URL (--database-url): the value of %s looks like %s, not a path: mount it as a file and give its path (the value is not shown)", k, what)
			}
		}
		if what := secretLike(os.Getenv(dsnFileParams[k])); what != "" {
			return usageErr("invalid %s (%s of the PostgreSQL connection): its value looks like %s, not a path: mount it as a file and give its path (the value is not shown)", dsnFileParams[k], k, what)
		}
	}
	return nil
}

// dsnError is pgx's error about dsn without the connection string it quotes (pgx masks only
// the password there) and without the value of any parameter of dsnSecretParams, from dsn or
// from libpq's environment variables.
func dsnError(dsn string, err error) string {
	s := err.Error()
	const lead = "cannot parse `"
	if rest, ok := strings.CutPrefix(s, lead); ok {
		if i := strings.LastIndex(rest, "`: "); i >= 0 {
			s = "cannot parse the connection string: " + rest[i+3:]
		}
	}
	p := dsnParams(dsn)
	var values []string
	for _, k := range dsnSecretParams {
		values = append(values, p[k], p[k+" raw"])
	}
	for _, env := range []string{"PGPASSWORD", "PGSSLPASSWORD", "PGSSLKEY", "PGSSLCERT", "PGSSLROOTCERT", "PGPASSFILE"} {
		values = append(values, os.Getenv(env))
	}
	return withoutValues(errors.New(s), values...)
}
