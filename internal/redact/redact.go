// Package redact hides credentials in connection strings before they are logged or printed.
package redact

import (
	"strings"
	"unicode"
)

// Mask replaces a secret.
const Mask = "xxxxx"

// DSN returns s with its credentials masked. s may be a URL (postgres://user:pass@host/db,
// nats://token@host), a comma-separated list of URLs (a NATS server list), or a libpq
// key=value string (host=h user=u password='p w'); in the last form the values of password,
// sslpassword and sslkey are masked. A NATS URL given without a scheme is a key=value string
// to DSN: mask NATS URLs with NATS.
func DSN(s string) string {
	if !strings.Contains(s, "://") {
		return keyValue(s)
	}
	parts := strings.Split(s, ",")
	for i, p := range parts {
		parts[i] = url(p)
	}
	return strings.Join(parts, ",")
}

// NATS returns the NATS server URL, or comma-separated list of them, s with its credentials
// masked: the password of user:password, or a lone token, in each server's userinfo, and every
// query value (a ws:// or wss:// URL's query goes to the server in the HTTP upgrade request,
// where a proxy may take a token from it; the relay refuses a query on the other schemes). A server
// given without a scheme (u:p@host:4222, which nats.go takes as nats://) is masked too.
func NATS(s string) string {
	parts := strings.Split(s, ",")
	for i, p := range parts {
		if strings.Contains(p, "://") {
			parts[i] = url(p)
			continue
		}
		lead := len(p) - len(strings.TrimLeft(p, " \t"))
		parts[i] = p[:lead] + strings.TrimPrefix(url("nats://"+p[lead:]), "nats://")
	}
	return strings.Join(parts, ",")
}

// url masks the password, or a lone token, in the userinfo of one URL, and a password given
// as a query parameter. Like net/url, it takes the authority to end at the first '/', '?' or
// '#', and the userinfo to end at the authority's last '@'.
func url(p string) string {
	scheme := strings.Index(p, "://")
	if scheme < 0 {
		return p
	}
	head, rest := p[:scheme+3], p[scheme+3:]
	end := len(rest)
	if j := strings.IndexAny(rest, "/?#"); j >= 0 {
		end = j
	}
	if at := strings.LastIndex(rest[:end], "@"); at >= 0 {
		cred := rest[:at]
		if user, _, ok := strings.Cut(cred, ":"); ok {
			cred = user + ":" + Mask
		} else if !strings.HasPrefix(head, "postgres") {
			cred = Mask // a NATS token
		}
		rest = cred + rest[at:]
	}
	return maskQueryIn(head+rest, !strings.HasPrefix(head, "postgres"))
}

// maskQueryIn masks a password given as a query parameter (postgres://h/db?password=p), or,
// with all (a NATS URL), every query value: a websocket URL's query is sent to the server (a
// proxy may read a token there), and a query on another scheme is a secret put in the wrong
// place more often than anything a reader needs (nats://h?token=t).
func maskQueryIn(p string, all bool) string {
	q := strings.IndexByte(p, '?')
	if q < 0 {
		return p
	}
	params := strings.Split(p[q+1:], "&")
	for i, kv := range params {
		k, _, ok := strings.Cut(kv, "=")
		if ok && (all || secretKey(k)) {
			params[i] = k + "=" + Mask
		}
	}
	return p[:q+1] + strings.Join(params, "&")
}

func secretKey(k string) bool {
	switch strings.ToLower(k) {
	case "password", "sslpassword", "sslkey":
		return true
	}
	return false
}

// keyValue masks the secret values of a libpq key=value string; values may be single-quoted
// with backslash escapes, and spaces may surround '='.
func keyValue(s string) string {
	var b strings.Builder
	last := 0
	scanKeyValues(s, func(key string, start, end int, _ string) {
		if secretKey(key) {
			b.WriteString(s[last:start])
			b.WriteString(Mask)
			last = end
		}
	})
	b.WriteString(s[last:])
	return b.String()
}

// KeyValues returns the parameters of a libpq key=value connection string (host=h
// password='p w'), their values unquoted and unescaped; of a key given twice, the last.
func KeyValues(s string) map[string]string {
	p := map[string]string{}
	scanKeyValues(s, func(key string, _, _ int, value string) { p[key] = value })
	return p
}

// scanKeyValues calls f for each key=value of the libpq connection string s, in order, with
// the span s[start:end] of the value as written (quotes and escapes included) and the value
// itself. Values may be single-quoted with backslash escapes, and spaces may surround '='.
func scanKeyValues(s string, f func(key string, start, end int, value string)) {
	i := 0
	for i < len(s) {
		for i < len(s) && unicode.IsSpace(rune(s[i])) {
			i++
		}
		start := i
		for i < len(s) && s[i] != '=' && !unicode.IsSpace(rune(s[i])) {
			i++
		}
		key := s[start:i]
		for i < len(s) && unicode.IsSpace(rune(s[i])) {
			i++
		}
		if i >= len(s) || s[i] != '=' {
			continue
		}
		i++
		for i < len(s) && unicode.IsSpace(rune(s[i])) {
			i++
		}
		start = i
		var v strings.Builder
		if i < len(s) && s[i] == '\'' {
			for i++; i < len(s) && s[i] != '\''; i++ {
				if s[i] == '\\' && i+1 < len(s) {
					i++
				}
				v.WriteByte(s[i])
			}
			i = min(i+1, len(s))
		} else {
			for ; i < len(s) && !unicode.IsSpace(rune(s[i])); i++ {
				if s[i] == '\\' && i+1 < len(s) {
					i++
				}
				v.WriteByte(s[i])
			}
		}
		f(key, start, i, v.String())
	}
}
