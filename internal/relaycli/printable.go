package relaycli

import (
	"fmt"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Text that comes from outside the relay (subjects, keys, headers, last errors written from
// NATS and checker answers, producer groups, business keys) is printed by the admin commands'
// text output through printable or cell, so that it cannot act on the operator's terminal
// (an ESC sequence clearing the screen or moving the cursor) or forge lines (a CR or LF
// followed by a fake row): JSON output escapes it already.

// controlRune reports whether a terminal acts on r rather than showing it: Unicode's control
// characters (C0, DEL, C1), the line and paragraph separators, and the bidirectional
// embedding, override and isolate characters (which reorder what follows them on the line).
func controlRune(r rune) bool {
	return unicode.IsControl(r) || r == '\u2028' || r == '\u2029' || ('\u202a' <= r && r <= '\u202e') || ('\u2066' <= r && r <= '\u2069')
}

// printable returns s with every control rune but tab (and tab too when escapeTab) written
// as Go writes it in a quoted string (\n, \r, \x1b, \u0085, \u202e), and every byte that is
// not UTF-8 as \xNN. A backslash is left as it is.
func printable(s string, escapeTab bool) string {
	clean := true
	for _, r := range s {
		if r == utf8.RuneError || (controlRune(r) && (r != '\t' || escapeTab)) {
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
		case controlRune(r) && (r != '\t' || escapeTab):
			q := strconv.QuoteRune(r)
			b.WriteString(q[1 : len(q)-1])
		default:
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// cell is s for a column of a text table: printable with tab escaped too (a tab would shift
// the columns), cut to at most n runes with "…" (n <= 0: no limit), "-" when empty.
func cell(s string, n int) string {
	if s == "" {
		return "-"
	}
	s = printable(s, true)
	if r := []rune(s); n > 0 && len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}
