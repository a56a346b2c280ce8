package relaycli

import (
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// A NATS URL nats.go would take but never connect with is a usage error naming --nats-url;
// lists as nats.go takes them are accepted.
func TestMalformedNATSURLIsRefused(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	for _, u := range []string{
		"nats://127.0.0.1:99999",           // port out of range
		"nats//127.0.0.1",                  // a typo: no scheme, a path
		"tcp://127.0.0.1:4222",             // not a NATS scheme
		"http://127.0.0.1:8222",            // the monitoring port's scheme
		"nats://127.0.0.1:4222?x=1",        // a query
		"nats://127.0.0.1:4222,",           // an empty server
		"ws://127.0.0.1:1,nats://h:2",      // websocket mixed with others
		"nats://user:Pw-33@127.0.0.1:4x22", // does not parse (and its password stays out)
	} {
		for _, cmd := range []string{"run", "checkback"} {
			t.Run(cmd+" "+u, func(t *testing.T) {
				t.Parallel()
				args := []string{cmd, "--database-url", db.DSN, "--schema", db.Schema, "--nats-url", u, "--log-format", "json"}
				if cmd == "checkback" {
					args = append(args, "--once")
				}
				p := startRelay(t, "relay-"+cmd, args...)
				if code := p.waitExit(t, 20*time.Second); code != 2 {
					t.Fatalf("exit %d, want 2:\n%s", code, p.output())
				}
				if out := p.output(); !strings.Contains(out, "invalid --nats-url") || strings.Contains(out, "Pw-33") {
					t.Errorf("the message does not name --nats-url, or shows the password:\n%s", out)
				}
			})
		}
	}
	for _, u := range []string{"nats://127.0.0.1:4222", "127.0.0.1", "nats://a:1, nats://b:2", "tls://h:4443", "nats://u:p@h:4222/", "wss://h,ws://g:80", "nats://h:"} {
		if err := checkNATSURL(u); err != nil {
			t.Errorf("checkNATSURL(%q) = %v, want it accepted", u, err)
		}
	}
}
