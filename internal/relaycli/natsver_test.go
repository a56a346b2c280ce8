package relaycli

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/relay"
)

// relay run and relay checkback refuse a nats-server older than they need at start (a real
// server whose INFO announces an old version): exit 1, with a message naming both versions.
func TestRunRefusesTooOldServer(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	cases := []struct {
		args             []string
		server, required string
	}{
		{[]string{"run", "--no-checkback"}, "2.8.4", relay.MinServerVersion},
		{[]string{"run"}, "2.8.4", relay.MinServerVersion},
		{[]string{"checkback"}, "2.1.9", checkback.MinServerVersion},
		{[]string{"checkback", "--once"}, "2.1.9", checkback.MinServerVersion},
	}
	for _, c := range cases {
		url := testsvc.VersionProxy(t, n.URL(), c.server)
		args := append(c.args, "--database-url", db.DSN, "--schema", db.Schema, "--nats-url", url)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		var out, errb bytes.Buffer
		code := Main(ctx, args, &Env{Stdout: &out, Stderr: &errb, Getenv: func(string) string { return "" }})
		expired := ctx.Err() != nil
		cancel()
		if code != 1 || expired {
			t.Errorf("%v: exit %d (timed out: %v), want 1:\n%s%s", c.args, code, expired, out.String(), errb.String())
			continue
		}
		want := "nats-server " + c.server + " is too old"
		if s := errb.String(); !strings.Contains(s, want) || !strings.Contains(s, "needs nats-server "+c.required+" or later") {
			t.Errorf("%v: stderr does not name both versions:\n%s", c.args, s)
		} else {
			t.Logf("relay %v: exit 1: %s", c.args, strings.TrimSpace(s))
		}
	}
}
