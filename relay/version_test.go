package relay

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// A relay connected to a nats-server older than MinServerVersion (a real server whose INFO
// announces 2.8.4) refuses it at start, naming both versions, and publishes nothing.
func TestRelayRefusesTooOldServer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.enqueue(outbox.Message{Subject: "orders.created", Payload: []byte("x")})

	nc, err := testsvc.Connect(testsvc.VersionProxy(t, e.nats.URL(), "2.8.4"))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if v := nc.ConnectedServerVersion(); v != "2.8.4" {
		t.Fatalf("the proxy announces %q", v)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(e.db.Pool, js, &Config{Schema: e.db.Schema, Logger: quietLogger(), PollMax: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = r.Run(ctx)
	var ve *txoutbox.ServerVersionError
	if !errors.Is(err, txoutbox.ErrServerTooOld) || !errors.As(err, &ve) {
		t.Fatalf("Run = %v, want txoutbox.ErrServerTooOld", err)
	}
	if ve.Server != "2.8.4" || ve.Required != MinServerVersion || !strings.Contains(err.Error(), "2.8.4") || !strings.Contains(err.Error(), MinServerVersion) {
		t.Errorf("error %q (%+v) does not name both versions", err, ve)
	}
	if msgs := testsvc.StreamMsgs(t, e.nats.JS, "ORDERS"); len(msgs) != 0 {
		t.Errorf("%d messages published by a relay that refused the server", len(msgs))
	}
}
