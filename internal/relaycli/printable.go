package relaycli

import "github.com/txoutbox/txoutbox/internal/safetext"

// Text that comes from outside the relay (subjects, keys, headers, last errors written from
// NATS and checker answers, producer groups, business keys) is printed by the admin commands'
// text output through printable or cell, so that it cannot act on the operator's terminal
// (an ESC sequence clearing the screen or moving the cursor) or forge lines (a CR or LF
// followed by a fake row): JSON output escapes it already.

// printable is safetext.Printable: s with every control rune but tab (and tab too when
// escapeTab) escaped as Go quotes it, and bytes that are not UTF-8 as \xNN.
func printable(s string, escapeTab bool) string { return safetext.Printable(s, escapeTab) }

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
