package relaycli

import (
	"strings"
	"testing"
)

// With the outbox outside the default schema, every command relay status suggests names it
// (--schema): run as printed, it acts on this outbox, not on public's.
func TestStatusSuggestsCommandsWithTheSchema(t *testing.T) {
	t.Parallel()
	e := newAdminEnv(t)
	code, out, errOut := cli(t, e.args("status")...)
	if code != 0 {
		t.Fatalf("relay status = %d: %s", code, errOut)
	}
	n := 0
	for _, part := range strings.Split(out, "relay ")[1:] {
		for _, cmd := range []string{"dead ", "prepared ", "scheduled ", "migrate "} {
			if strings.HasPrefix(part, cmd) {
				n++
				line, _, _ := strings.Cut(part, "\n")
				if !strings.Contains(line, "--schema "+e.db.Schema) {
					t.Errorf("relay status suggests a command without --schema %s: %q", e.db.Schema, "relay "+line)
				}
			}
		}
	}
	if n == 0 {
		t.Errorf("relay status suggests no command:\n%s", out)
	}
}

// An admin command pointed at a schema without an outbox (the outbox lives elsewhere and
// --schema was left out) says so and names --schema, before suggesting to create one.
func TestNoOutboxInSchemaNamesSchemaSetting(t *testing.T) {
	t.Parallel()
	e := newAdminEnv(t)
	for _, cmd := range [][]string{{"dead", "list"}, {"prepared", "list"}, {"scheduled", "list"}, {"status"}} {
		args := append(cmd, "--database-url", e.db.DSN, "--schema", "no_outbox_here")
		code, out, errOut := cli(t, args...)
		if code != 1 || !strings.Contains(errOut, `schema "no_outbox_here" has no outbox`) || !strings.Contains(errOut, "--schema") {
			t.Errorf("%v: exit %d, %q %q; want 1 saying the schema has no outbox and naming --schema", cmd, code, out, errOut)
		}
	}
}
