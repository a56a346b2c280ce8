package store

import "testing"

// The keys of an explained claim reach the statement as they are: quoted as array elements
// (backslash and double quote escaped, nothing else: inner white space such as a no-break
// space, commas, braces and quotes kept) inside an SQL string constant.
func TestTextArrayLiteral(t *testing.T) {
	for _, c := range []struct {
		in   []string
		want string
	}{
		{nil, `'{}'::text[]`},
		{[]string{"a", "b"}, `'{"a","b"}'::text[]`},
		{[]string{`say "hi"`, `back\slash`}, `'{"say \"hi\"","back\\slash"}'::text[]`},
		{[]string{"it's", "a,b{c}", "no\u00a0break", "NULL"}, `'{"it''s","a,b{c}","no` + "\u00a0" + `break","NULL"}'::text[]`},
	} {
		if got := textArray(c.in); got != c.want {
			t.Errorf("textArray(%q) = %s, want %s", c.in, got, c.want)
		}
	}
}
