package testsvc

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// DropRoleAtCleanup drops role name (DROP OWNED BY, then DROP ROLE, as super) when the test
// ends. Call it before testsvc.NewDB: cleanups run last first, so the role goes after the
// test's schema, which may hold objects it owns or was granted.
func DropRoleAtCleanup(tb testing.TB, super *pgxpool.Pool, name string) {
	tb.Helper()
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = super.Exec(ctx, "DROP OWNED BY "+name)
		if _, err := super.Exec(ctx, "DROP ROLE "+name); err != nil {
			tb.Logf("drop role %s: %v", name, err)
		}
	})
}

// CreateRole creates role name with attrs (LOGIN, NOLOGIN, …) as super, and drops it when the
// test ends (DropRoleAtCleanup: create it before testsvc.NewDB).
func CreateRole(tb testing.TB, super *pgxpool.Pool, name, attrs string) {
	tb.Helper()
	if _, err := super.Exec(context.Background(), "CREATE ROLE "+name+" "+attrs); err != nil {
		tb.Fatal(err)
	}
	DropRoleAtCleanup(tb, super, name)
}
