package cmdline

import "testing"

// The commands the status page, /status.json and relay status suggest name the schema unless
// it is the default, quoted for a shell when it has to be.
func TestCommand(t *testing.T) {
	for _, c := range []struct {
		schema string
		words  []string
		want   string
	}{
		{"public", []string{"relay dead list"}, "relay dead list"},
		{"", []string{"relay dead list"}, "relay dead list"},
		{"billing", []string{"relay dead requeue --id", "ID"}, "relay dead requeue --id ID --schema billing"},
		{"Billing_2", []string{"relay scheduled list"}, "relay scheduled list --schema Billing_2"},
		{"my schema", []string{"relay dead list"}, "relay dead list --schema 'my schema'"},
		{"o'brien", []string{"relay dead list"}, `relay dead list --schema 'o'\''brien'`},
		{"$(rm -rf x)", []string{"relay dead list"}, "relay dead list --schema '$(rm -rf x)'"},
		{"a;b", []string{"relay dead list"}, "relay dead list --schema 'a;b'"},
	} {
		if got := Command(c.schema, c.words...); got != c.want {
			t.Errorf("Command(%q, %q) = %q, want %q", c.schema, c.words, got, c.want)
		}
	}
}
