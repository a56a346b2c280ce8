package safetext

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestText(t *testing.T) {
	cases := []struct {
		name, in string
		max      int
		want     string
	}{
		{"plain", "checker down", 100, "checker down"},
		{"nul", "a\x00b", 100, "a\uFFFDb"},
		{"invalid utf8", "a\xffb\xc3", 100, "a\uFFFDb\uFFFD"},
		{"no limit", strings.Repeat("x", 5000), 0, strings.Repeat("x", 5000)},
		{"cut ascii", "abcdefghij", 8, "abcde" + Ellipsis},
		// "é" is 2 bytes: a cut at byte 6 would split the third one.
		{"cut inside a character", "ééééé", 8, "éé" + Ellipsis},
		{"exactly at the limit", "ééé", 6, "ééé"},
		{"newlines kept", "line 1\nline 2", 100, "line 1\nline 2"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := Text(c.in, c.max)
			if got != c.want {
				t.Fatalf("Text(%q, %d) = %q, want %q", c.in, c.max, got, c.want)
			}
			if !utf8.ValidString(got) || strings.IndexByte(got, 0) >= 0 {
				t.Fatalf("Text(%q) = %q: not storable", c.in, got)
			}
			if c.max > 0 && len(got) > c.max {
				t.Fatalf("Text(%q, %d) is %d bytes", c.in, c.max, len(got))
			}
		})
	}
}

func TestHeader(t *testing.T) {
	cases := []struct {
		name, in string
		max      int
		want     string
	}{
		{"plain", "handler failed", 100, "handler failed"},
		{"crlf and tab", "a\r\nb\tc", 100, "a  b c"},
		{"edges trimmed", " \t x \u00a0", 100, "x"},
		{"nul and c1", "a\x00b\u0085c", 100, "a b c"},
		{"invalid", "\xffx", 100, "\uFFFDx"},
		{"cut keeps no trailing blank", "abc   defgh", 8, "abc" + Ellipsis},
		{"cut inside a character", strings.Repeat("€", 10), 10, "€€" + Ellipsis},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := Header(c.in, c.max)
			if got != c.want {
				t.Fatalf("Header(%q, %d) = %q, want %q", c.in, c.max, got, c.want)
			}
			if len(got) > c.max || !utf8.ValidString(got) || strings.ContainsAny(got, "\x00\r\n") {
				t.Fatalf("Header(%q) = %q: not a valid header value within %d bytes", c.in, got, c.max)
			}
		})
	}
}

// FuzzText checks the contract on any input: valid UTF-8, no NUL, within the limit.
func FuzzText(f *testing.F) {
	f.Add("abc\x00\xff€", 5)
	f.Fuzz(func(t *testing.T, s string, max int) {
		max = max % 4096
		got := Text(s, max)
		if !utf8.ValidString(got) || strings.IndexByte(got, 0) >= 0 {
			t.Fatalf("Text(%q, %d) = %q", s, max, got)
		}
		if max > 0 && len(got) > max {
			t.Fatalf("Text(%q, %d) is %d bytes", s, max, len(got))
		}
		h := Header(s, max)
		if !utf8.ValidString(h) || strings.ContainsAny(h, "\x00\r\n") || (max > 0 && len(h) > max) {
			t.Fatalf("Header(%q, %d) = %q", s, max, h)
		}
	})
}
