package migrations_test

import (
	"strings"
	"testing"

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
