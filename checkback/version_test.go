package checkback

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// The check-back refuses a nats-server older than MinServerVersion (a real server whose INFO
// announces 2.1.9), in RunOnce and in Run, naming both versions.
func TestCheckbackRefusesTooOldServer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	nc, err := testsvc.Connect(testsvc.VersionProxy(t, e.nats.URL(), "2.1.9"))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	cfg := fastConfig()
	cfg.Schema = e.db.Schema
	cfg.Logger = testLogger()
	cb, err := New(e.db.Pool, nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, onceErr := cb.RunOnce(ctx)
	runErr := cb.Run(ctx) // returns at once: it would otherwise run until ctx ends
	for name, err := range map[string]error{"RunOnce": onceErr, "Run": runErr} {
		var ve *txoutbox.ServerVersionError
		if !errors.Is(err, txoutbox.ErrServerTooOld) || !errors.As(err, &ve) || ve.Server != "2.1.9" || ve.Required != MinServerVersion {
			t.Errorf("%s = %v, want txoutbox.ErrServerTooOld", name, err)
			continue
		}
		if !strings.Contains(err.Error(), "2.1.9") || !strings.Contains(err.Error(), MinServerVersion) {
			t.Errorf("%s: %q does not name both versions", name, err)
		}
	}
	// The real server (2.12 and later) passes.
	if _, err := e.checkback(nil).RunOnce(ctx); err != nil {
		t.Errorf("RunOnce against the real server: %v", err)
	}
}
