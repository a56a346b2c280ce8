// Package safetext makes text that comes from outside the process (checker replies and errors,
// JetStream errors, handler errors, dead-letter reasons) safe to store in a PostgreSQL text
// column or to send as a NATS header value.
//
// PostgreSQL refuses a NUL byte and invalid UTF-8 in text (SQLSTATE 22021), and a cut made by
// byte count can split a multi-byte character; NATS header values cannot hold CR or LF, and
// lose leading and trailing blanks. Every such text goes through Text (to store) or Header (to
// send) first, so that recording it can never fail.
package safetext

import (
	"fmt"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Ellipsis marks a text that was cut.
const Ellipsis = "…"

// Text returns s as valid UTF-8 without NUL bytes, at most maxBytes bytes long (maxBytes <= 0
// means no limit). Invalid bytes and NULs become U+FFFD; a text over the limit is cut on a
// character boundary and ends with Ellipsis (the result, ellipsis included, fits the limit).
func Text(s string, maxBytes int) string {
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	if strings.IndexByte(s, 0) >= 0 {
		s = strings.ReplaceAll(s, "\x00", "\uFFFD")
	}
	return Cut(s, maxBytes)
}

// Header returns s as a single-line NATS header value: as Text, with every control character
// (CR, LF, TAB, NUL and the rest of Unicode's Cc category) replaced by a space and leading and
// trailing white space removed, so that it arrives as it is sent.
func Header(s string, maxBytes int) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
	s = strings.TrimFunc(s, unicode.IsSpace)
	s = Cut(s, maxBytes)
	return strings.TrimRightFunc(strings.TrimSuffix(s, Ellipsis), unicode.IsSpace) + ellipsisIfCut(s)
}

func ellipsisIfCut(s string) string {
	if strings.HasSuffix(s, Ellipsis) {
		return Ellipsis
	}
	return ""
}

// Cut returns s cut to at most maxBytes bytes on a character boundary, ending with Ellipsis
// when it was cut (maxBytes <= 0 means no limit). s must be valid UTF-8.
func Cut(s string, maxBytes int) string {
	if maxBytes <= 0 || len(s) <= maxBytes {
		return s
	}
	room := maxBytes - len(Ellipsis)
	if room < 0 {
		room = maxBytes
	}
	i := room
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	if room == maxBytes {
		return s[:i]
	}
	return s[:i] + Ellipsis
}

// ControlRune reports whether a terminal acts on r rather than showing it: Unicode's control
// characters (C0, DEL, C1), the line and paragraph separators, and the bidirectional
// embedding, override and isolate characters (which reorder what follows them on the line).
func ControlRune(r rune) bool {
	return unicode.IsControl(r) || r == '\u2028' || r == '\u2029' || ('\u202a' <= r && r <= '\u202e') || ('\u2066' <= r && r <= '\u2069')
}

// Printable returns s with every control rune but tab (and tab too when escapeTab) written
// as Go writes it in a quoted string (\n, \r, \x1b, \u0085, \u202e), and every byte that is
// not UTF-8 as \xNN. A backslash is left as it is. Text from outside the process goes through
// it before a terminal shows it: it cannot act on the terminal (an ESC sequence) or forge
// lines (a CR or LF followed by a fake row).
func Printable(s string, escapeTab bool) string {
	clean := true
	for _, r := range s {
		if r == utf8.RuneError || (ControlRune(r) && (r != '\t' || escapeTab)) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case ControlRune(r) && (r != '\t' || escapeTab):
			q := strconv.QuoteRune(r)
			b.WriteString(q[1 : len(q)-1])
		default:
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}
