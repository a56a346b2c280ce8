package relay

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// The relay publishes through a JetStream built like the caller's: a JetStream domain and a
// client trace are honoured, not silently replaced by the defaults.
func TestPublisherKeepsTheCallersDomainAndTrace(t *testing.T) {
	t.Parallel()
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true,
		JetStreamDomain: "hub", StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	t.Cleanup(srv.Shutdown)
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	var viaDomain, elsewhere atomic.Int64
	trace := &jetstream.ClientTrace{RequestSent: func(subj string, _ []byte) {
		if strings.HasPrefix(subj, "$JS.hub.API.") {
			viaDomain.Add(1)
		} else {
			elsewhere.Add(1)
		}
	}}
	js, err := jetstream.NewWithDomain(nc, "hub", jetstream.WithClientTrace(trace), jetstream.WithDefaultTimeout(7*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "HUB", Subjects: []string{"hub.>"}, Duplicates: 2 * time.Minute}); err != nil {
		t.Fatal(err)
	}

	db := testsvc.NewDB(t)
	r, err := New(db.Pool, js, &Config{Schema: db.Schema, Logger: quietLogger(), LeaseInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	if o := r.pub.Options(); o.Domain != "hub" || o.ClientTrace == nil || o.DefaultTimeout != 7*time.Second {
		t.Fatalf("publisher options: domain %q, trace %v, default timeout %s; want the caller's", o.Domain, o.ClientTrace != nil, o.DefaultTimeout)
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "hub.x", Payload: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	drain(t, r)
	s, err := js.Stream(ctx, "HUB")
	if err != nil {
		t.Fatal(err)
	}
	if s.CachedInfo().State.Msgs != 1 {
		t.Fatalf("stream holds %d messages, want 1", s.CachedInfo().State.Msgs)
	}
	// The publisher's own API requests (here its account probe) go through the domain and
	// are traced.
	before := viaDomain.Load()
	if _, err := r.pub.AccountInfo(ctx); err != nil {
		t.Fatal(err)
	}
	if viaDomain.Load() == before || elsewhere.Load() != 0 {
		t.Fatalf("traced API requests: %d via the domain (%d before), %d elsewhere; want one more via $JS.hub.API and none elsewhere",
			viaDomain.Load(), before, elsewhere.Load())
	}
}
