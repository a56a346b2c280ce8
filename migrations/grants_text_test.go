package migrations_test

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/migrations"
)

// Consumer names go into the row-level security policies as SQL literals, exactly: a '%' (which
// JetStream allows in names) or a quote is never read as formatting or closes the literal.
func TestGrantsConsumerNamesAreWrittenAsGiven(t *testing.T) {
	t.Parallel()
	sql, err := migrations.Grants(migrations.RoleConsumer, "public", "app_consumer",
		&migrations.GrantOptions{Consumers: []string{"orders%v", "a%%b", "o'q"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`'orders%v'`, `'a%%b'`, `'o''q'`} {
		if !strings.Contains(sql, want) {
			t.Errorf("the grants lack the literal %s:\n%s", want, sql)
		}
	}
	if strings.Contains(sql, "%!") {
		t.Errorf("the grants hold a formatting error:\n%s", sql)
	}
}

// A bad argument of Grants or Export is a *txoutbox.ConfigError naming it, with the package,
// matching txoutbox.ErrInvalidConfig, and writes nothing: a bad schema (empty, too long, a NUL
// byte, a '$'), a grantee that is no role name, a role Grants does not know (still matching
// ErrUnknownRole) and an unknown export format.
func TestGrantsAndExportArgumentErrorsAreConfigErrors(t *testing.T) {
	t.Parallel()
	grants := func(role, schema, grantee string) func() (string, error) {
		return func() (string, error) { return migrations.Grants(role, schema, grantee, nil) }
	}
	dir := t.TempDir()
	for _, c := range []struct {
		name, field, says string
		call              func() (string, error)
		is                error
	}{
		{"empty schema", "schema", "must not be empty", grants(migrations.RoleRelay, "", "app"), nil},
		{"long schema", "schema", "63-byte", grants(migrations.RoleRelay, strings.Repeat("s", 64), "app"), nil},
		{"NUL in schema", "schema", "NUL", grants(migrations.RoleRelay, "out\x00box", "app"), nil},
		{"'$' in schema", "schema", "'$'", grants(migrations.RoleRelay, "out$box", "app"), nil},
		{"empty grantee", "grantee", "role name", grants(migrations.RoleRelay, "public", ""), nil},
		{"grantee with a space", "grantee", "role name", grants(migrations.RoleRelay, "public", "bad name"), nil},
		{"grantee starting with a digit", "grantee", "role name", grants(migrations.RoleRelay, "public", "1app"), nil},
		{"unknown role", "role", "operator", grants("operator", "public", "app"), migrations.ErrUnknownRole},
		{"unknown format", "format", "flyway", func() (string, error) {
			written, err := migrations.Export(dir, "flyway")
			return strings.Join(written, ","), err
		}, nil},
	} {
		out, err := c.call()
		var ce *txoutbox.ConfigError
		if !errors.As(err, &ce) || ce.Package != "migrations" || ce.Field != c.field || !errors.Is(err, txoutbox.ErrInvalidConfig) {
			t.Errorf("%s: %v (%T), want a *txoutbox.ConfigError of package migrations naming %s", c.name, err, err, c.field)
			continue
		}
		if !strings.HasPrefix(err.Error(), "migrations: "+c.field+" ") || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: %q, want it to start with %q and say %q", c.name, err, "migrations: "+c.field+" ", c.says)
		}
		if c.is != nil && !errors.Is(err, c.is) {
			t.Errorf("%s: %v does not match %v", c.name, err, c.is)
		}
		if out != "" {
			t.Errorf("%s: returned %q besides the error", c.name, out)
		}
	}
	if entries, err := os.ReadDir(dir); err != nil || len(entries) != 0 {
		t.Errorf("Export with an unknown format left %d entries in its directory (%v)", len(entries), err)
	}
}
