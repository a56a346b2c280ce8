package relaycli

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// The relay binary's pool turns JIT compilation off after connecting (never as a startup
// parameter, which poolers such as PgBouncer refuse), unless the URL sets jit itself.
func TestPoolTurnsJITOff(t *testing.T) {
	ctx := context.Background()
	base := testsvc.PostgresDSN(t)
	for _, tc := range []struct {
		dsn  string
		want string
	}{
		{base, "off"},
		{withJITOn(base), "on"},
	} {
		c, err := connect(ctx, connectOptions{DSN: tc.dsn, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		var jit string
		err = c.Pool.QueryRow(ctx, "SELECT current_setting('jit')").Scan(&jit)
		c.Close()
		if err != nil || jit != tc.want {
			t.Errorf("%s: jit = %q (%v), want %q", tc.dsn, jit, err, tc.want)
		}
	}
}

// withJITOn adds options=-c jit=on to a URL or keyword/value connection string.
func withJITOn(dsn string) string {
	switch {
	case !strings.HasPrefix(dsn, "postgres://") && !strings.HasPrefix(dsn, "postgresql://"):
		return dsn + " options='-c jit=on'"
	case strings.Contains(dsn, "?"):
		return dsn + "&options=-c%20jit%3Don"
	}
	return dsn + "?options=-c%20jit%3Don"
}
