package consumer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/natsver"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// On the machine's own nats-server when it is older than MinServerVersion (Debian's 2.9.10
// here, whose redeliveries of nak'ed messages lose their place and their delivery count, and
// which ignores a terminate carrying a reason), the consumer refuses to start, naming both
// versions, before it creates its durable: Setup, and Run at once (no wait).
func TestConsumerRefusesTheSystemServerWhenTooOld(t *testing.T) {
	t.Parallel()
	version, _, js := testsvc.SystemNATS(t)
	if less, err := natsver.Less(version, MinServerVersion); err != nil || !less {
		t.Skipf("skipping: the machine's nats-server %s is not older than %s (%v)", version, MinServerVersion, err)
	}
	db := testsvc.NewDB(t)
	c, err := New(db.Pool, js, func(context.Context, pgx.Tx, Message) error { return nil },
		&Config{Stream: testStream, Durable: testDurable, Schema: db.Schema, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var ve *txoutbox.ServerVersionError
	if _, err := c.Setup(ctx); !errors.As(err, &ve) || ve.Server != version || ve.Required != MinServerVersion {
		t.Fatalf("Setup on nats-server %s: %v, want txoutbox.ErrServerTooOld requiring %s", version, err, MinServerVersion)
	}
	if err := c.Run(ctx); !errors.Is(err, txoutbox.ErrServerTooOld) {
		t.Fatalf("Run on nats-server %s: %v, want txoutbox.ErrServerTooOld at once", version, err)
	}
	if ctx.Err() != nil {
		t.Fatal("Run waited instead of refusing")
	}
	t.Logf("nats-server %s refused: %v", version, ve)
}
