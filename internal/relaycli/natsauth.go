package relaycli

import (
	"net/url"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
)

// natsAuth are the NATS credentials and TLS settings of a command that connects to NATS.
// Secrets (the password, the token) are never logged; their defaults are empty, so --help
// never shows one.
type natsAuth struct {
	creds, nkey    string
	user, password string
	token          string
	cert, key, ca  string
	tlsFirst       bool
}

// defineNATSAuthFlags adds the NATS authentication and TLS settings to s (after --nats-url).
func defineNATSAuthFlags(s *settings, a *natsAuth) {
	sec := s.Section("NATS authentication and TLS")
	s.String(&a.creds, "nats-creds", "", "", "NATS credentials file (a user JWT and its NKey seed, as nsc and the nats CLI write)")
	sec("nats-creds")
	s.String(&a.nkey, "nats-nkey", "", "", "file holding the NKey seed of an NKey user (SU...)")
	s.String(&a.user, "nats-user", "", "", "NATS user name (with --nats-password)")
	s.String(&a.password, "nats-password", "", "", "NATS password of --nats-user (prefer the environment variable to the command line)")
	s.String(&a.token, "nats-token", "", "", "NATS authentication token (prefer the environment variable to the command line)")
	s.String(&a.cert, "nats-tls-cert", "", "", "client certificate file (PEM) for NATS servers that verify clients (with --nats-tls-key)")
	s.String(&a.key, "nats-tls-key", "", "", "private key file (PEM) of --nats-tls-cert")
	s.String(&a.ca, "nats-tls-ca", "", "", "CA bundle file (PEM) that verifies the NATS server's certificate (default: the system's roots)")
	s.Bool(&a.tlsFirst, "nats-tls-first", "", false, "start with the TLS handshake instead of waiting for the server's INFO (servers with handshake_first)")
}

// options returns the nats.go options the settings ask for, after checking that they are
// consistent (one authentication method at most, counting credentials in natsURL, the
// --nats-url value) and that every file they name loads and parses: a mistake is a usage error
// (exit status 2) naming the setting, before anything connects.
func (a *natsAuth) options(natsURL string) ([]nats.Option, error) {
	if a == nil {
		return nil, nil
	}
	var opts []nats.Option
	methods := 0
	for _, set := range []bool{a.creds != "", a.nkey != "", a.user != "" || a.password != "", a.token != ""} {
		if set {
			methods++
		}
	}
	if methods > 1 {
		return nil, usageErr("NATS authentication: set one of --nats-creds, --nats-nkey, --nats-user/--nats-password and --nats-token")
	}
	if methods == 1 && urlHasCredentials(natsURL) {
		return nil, usageErr("NATS authentication: --nats-url carries credentials (user:password@ or token@) and one of --nats-creds, --nats-nkey, --nats-user/--nats-password and --nats-token is set: set one")
	}
	// Every file is checked before nats.go reads it, and nats.go's errors lose the values: a
	// value of these settings is never shown (it may be the secret itself, pasted where its
	// file's path goes).
	for _, f := range []struct{ flag, path string }{
		{"nats-creds", a.creds}, {"nats-nkey", a.nkey}, {"nats-tls-cert", a.cert}, {"nats-tls-key", a.key}, {"nats-tls-ca", a.ca},
	} {
		if f.path != "" {
			if err := checkSecretFile(settingName(f.flag), f.path); err != nil {
				return nil, err
			}
		}
	}
	hide := func(err error) string {
		return withoutValues(err, a.creds, a.nkey, a.cert, a.key, a.ca, a.password, a.token)
	}
	switch {
	case a.creds != "":
		o := nats.UserCredentials(a.creds)
		// nats.go reads the file at each connection: parse it now, the user JWT and the seed
		// (signing a nonce), so that a file that is not a credentials file is refused here.
		probe := nats.GetDefaultOptions()
		if err := o(&probe); err != nil {
			return nil, usageErr("invalid %s: %s", settingName("nats-creds"), hide(err))
		}
		token, err := probe.UserJWT()
		if err == nil {
			_, err = jwt.DecodeUserClaims(token)
		}
		if err != nil {
			return nil, usageErr("invalid %s: not a credentials file: no user JWT: %s", settingName("nats-creds"), hide(err))
		}
		if _, err := probe.SignatureCB([]byte("txoutbox")); err != nil {
			return nil, usageErr("invalid %s: not a credentials file: %s", settingName("nats-creds"), hide(err))
		}
		opts = append(opts, o)
	case a.nkey != "":
		o, err := nats.NkeyOptionFromSeed(a.nkey)
		if err != nil {
			return nil, usageErr("invalid %s: not an NKey seed file: %s", settingName("nats-nkey"), hide(err))
		}
		opts = append(opts, o)
	case a.user != "" || a.password != "":
		if a.user == "" {
			return nil, usageErr("--nats-password needs --nats-user")
		}
		opts = append(opts, nats.UserInfo(a.user, a.password))
	case a.token != "":
		opts = append(opts, nats.Token(a.token))
	}
	if (a.cert == "") != (a.key == "") {
		return nil, usageErr("--nats-tls-cert and --nats-tls-key go together")
	}
	var tlsOpts []nats.Option
	if a.cert != "" {
		tlsOpts = append(tlsOpts, nats.ClientCert(a.cert, a.key))
	}
	if a.ca != "" {
		tlsOpts = append(tlsOpts, nats.RootCAs(a.ca))
	}
	// Load the files now (nats.go would only at connect): the certificate, the key and the CA
	// bundle must parse.
	probe := nats.GetDefaultOptions()
	for i, o := range tlsOpts {
		if err := o(&probe); err != nil {
			which := settingName("nats-tls-cert") + " or " + settingName("nats-tls-key")
			if a.cert == "" || i == 1 {
				which = settingName("nats-tls-ca")
			}
			return nil, usageErr("invalid %s: %s", which, hide(err))
		}
	}
	opts = append(opts, tlsOpts...)
	if a.tlsFirst {
		opts = append(opts, nats.TLSHandshakeFirst())
	}
	return opts, nil
}

// urlHasCredentials reports whether a server of a NATS URL list carries a user, a password or
// a token (nats://user:password@host, nats://token@host). A URL that does not parse is
// checkNATSURL's to refuse.
func urlHasCredentials(natsURL string) bool {
	for _, u := range strings.Split(natsURL, ",") {
		u = strings.TrimSpace(u)
		if u == "" {
			continue
		}
		if !strings.Contains(u, "://") {
			u = "nats://" + u
		}
		if p, err := url.Parse(u); err == nil && p.User != nil {
			return true
		}
	}
	return false
}
