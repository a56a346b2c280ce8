package checkback

import (
	"errors"
	"testing"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// New refuses a database handle that is one connection (its jobs and the checks of several
// groups use it at once) with a *txoutbox.ConfigError naming db, and takes a pool.
func TestNewRefusesSingleConnection(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	for name, h := range testsvc.SingleConnections(t, db) {
		cb, err := New(h, nil, &Config{Schema: db.Schema, Logger: testLogger()})
		var ce *txoutbox.ConfigError
		if !errors.As(err, &ce) || ce.Package != "checkback" || ce.Field != "db" || !errors.Is(err, txoutbox.ErrInvalidConfig) {
			t.Errorf("New(%s): check-back %v, err %v; want a *txoutbox.ConfigError naming db", name, cb != nil, err)
		}
	}
	if _, err := New(db.Pool, nil, &Config{Schema: db.Schema, Logger: testLogger()}); err != nil {
		t.Errorf("New(pool): %v", err)
	}
}
