package relaycli

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/embedded"
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
		"nats://127.0.0.1:4222:99",         // a second port: the host would be "127.0.0.1:4222"
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
	for _, u := range []string{"nats://127.0.0.1:4222", "127.0.0.1", "nats://a:1, nats://b:2", "tls://h:4443", "nats://u:p@h:4222/", "wss://h,ws://g:80", "nats://h:", "nats://[::1]:4222", "[::1]:4222"} {
		if err := checkNATSURL(u); err != nil {
			t.Errorf("checkNATSURL(%q) = %v, want it accepted", u, err)
		}
	}
}

// A websocket URL may carry a path and a query (nats.go sends them in the upgrade request, for
// a proxy that routes on them); a nats:// or tls:// URL may not (nats.go ignores them, so one
// there is a mistake), and no URL has a fragment. A path-routed websocket URL really connects.
func TestNATSURLPathOnlyForWebsocket(t *testing.T) {
	t.Parallel()
	for u, ok := range map[string]bool{
		"wss://nats.example.com/nats":          true,
		"ws://127.0.0.1:8080/nats?token=t":     true,
		"wss://a.example.com/x,wss://b:443/y":  true,
		"ws://h/":                              true,
		"nats://127.0.0.1:4222/nats":           false,
		"tls://h:4443/x":                       false,
		"nats://h:4222?x=1":                    false,
		"ws://h:80/nats#frag":                  false,
		"nats://h:4222#frag":                   false,
		"nats://h:4222:99":                     false,
		"nats://::1:4222":                      false,
		"wss://a.example.com/x,nats://b:4222/": false, // mixed
	} {
		err := checkNATSURL(u)
		var ue *usageError
		if (err == nil) != ok || err != nil && (!errors.As(err, &ue) || !strings.Contains(err.Error(), "--nats-url")) {
			t.Errorf("checkNATSURL(%q) = %v, want accepted=%v (a usage error naming --nats-url otherwise)", u, err, ok)
		}
	}

	wsPort, err := embedded.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	srv, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true,
		Websocket: server.WebsocketOpts{Host: "127.0.0.1", Port: wsPort, NoTLS: true},
	})
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	t.Cleanup(srv.Shutdown)
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	u := fmt.Sprintf("ws://127.0.0.1:%d/nats?client=relay", wsPort)
	if err := checkNATSURL(u); err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(u, nats.Timeout(5*time.Second))
	if err != nil {
		t.Fatalf("connect to %s: %v", u, err)
	}
	defer nc.Close()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}
