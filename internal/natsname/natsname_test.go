package natsname

import (
	"strings"
	"testing"
)

func TestCovers(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		filter, subj string
		want         bool
	}{
		// Filters against filters (the relay: does a stream capture a whole subject filter?).
		{"orders.>", "orders.>", true}, {"orders.>", "orders.eu.*", true}, {"orders.>", "orders.a", true},
		{"orders.>", "orders", false}, {">", "a.b.>", true}, {"orders.*", "orders.a", true},
		{"orders.*", "orders.*", true}, {"orders.*", "orders.>", false}, {"orders.*", "orders.a.b", false},
		{"orders.a", "orders.*", false}, {"orders.a", "orders.a", true}, {"orders.a", "orders.b", false},
		{"orders.*.x", "orders.eu.x", true}, {"orders.*.x", "orders.eu.*", false}, {"a.b", "a", false},
		// Filters against literal subjects (the consumer: does a filter take the dead letters?).
		{"orders.>", "orders.dead", true}, {"orders.*", "orders.a.b", false},
		{"orders.*.b", "orders.a.b", true}, {"txoutbox.dead.x", "txoutbox.dead.x", true},
		{"txoutbox.dead.x", "txoutbox.dead.y", false},
	} {
		if got := Covers(tc.filter, tc.subj); got != tc.want {
			t.Errorf("Covers(%q, %q) = %v, want %v", tc.filter, tc.subj, got, tc.want)
		}
	}
}

func TestValidateName(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"ORDERS", "orders-v2", "a_b", strings.Repeat("s", MaxNameLength)} {
		if err := ValidateName(ok); err != nil {
			t.Errorf("ValidateName(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"", strings.Repeat("s", MaxNameLength+1), "a.b", "a*", "a>", "a b", "a\tb", "a/b", `a\b`, "a\nb"} {
		if err := ValidateName(bad); err == nil {
			t.Errorf("ValidateName(%q) accepted it", bad)
		}
	}
}
