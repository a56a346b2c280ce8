package consumer

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// Setup refuses a nats-server older than MinServerVersion (2.10.16), naming both versions: a
// real server whose INFO announces an older version is refused, whatever the filter subjects;
// the same server announcing 2.10.16 is taken.
func TestSetupRefusesTooOldServer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	nop := func(context.Context, pgx.Tx, Message) error { return nil }
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	via := func(version string) jetstream.JetStream {
		nc, err := testsvc.Connect(testsvc.VersionProxy(t, e.nats.URL(), version))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		return js
	}
	two := []string{"orders.created", "orders.paid"}

	cases := []struct {
		version, durable string
		filters          []string
		required         string // "" when taken
	}{
		{"2.9.25", "two_old", two, MinServerVersion},
		{"2.10.15", "two_almost", two, MinServerVersion},
		{"2.10.16", "two_new", two, ""},
		{"2.10.4", "one_old", []string{"orders.created"}, MinServerVersion},
		{"2.11.0", "one_new", []string{"orders.created"}, ""},
		{"2.8.4", "all_old", nil, MinServerVersion},
	}
	for _, c := range cases {
		cons := e.newConsumer(via(c.version), &Config{Durable: c.durable, FilterSubjects: c.filters}, nop)
		_, err := cons.Setup(ctx)
		if c.required == "" {
			if err != nil {
				t.Errorf("%s with %d filter subjects: %v", c.version, len(c.filters), err)
			}
			continue
		}
		var ve *txoutbox.ServerVersionError
		if !errors.Is(err, txoutbox.ErrServerTooOld) || !errors.As(err, &ve) || ve.Server != c.version || ve.Required != c.required {
			t.Errorf("%s with %d filter subjects: Setup = %v, want txoutbox.ErrServerTooOld requiring %s", c.version, len(c.filters), err, c.required)
			continue
		}
		if !strings.Contains(err.Error(), c.version) || !strings.Contains(err.Error(), c.required) {
			t.Errorf("%q does not name both versions", err)
		}
		// Refused before the durable consumer is created.
		if _, err := e.nats.JS.Consumer(ctx, testStream, c.durable); !errors.Is(err, jetstream.ErrConsumerNotFound) {
			t.Errorf("durable %s after a refused Setup: %v", c.durable, err)
		}
	}
}
