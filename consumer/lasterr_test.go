package consumer

import (
	"errors"
	"fmt"
	"log/slog"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// JetStream reports consume errors of many types (found by the demo: closing the connection
// under a running consumer); recording them one after another must not panic.
func TestConsumeErrorsOfDifferentTypes(t *testing.T) {
	t.Parallel()
	c := &Consumer{log: slog.New(slog.DiscardHandler)}
	for _, err := range []error{errors.New("plain"), fmt.Errorf("wrapped: %w", jetstream.ErrNoHeartbeat), jetstream.ErrConsumerDeleted} {
		c.consumeError(err)
	}
	if p := c.lastErr.Load(); p == nil || !errors.Is(*p, jetstream.ErrConsumerDeleted) {
		t.Fatalf("last error %v, want the last one recorded", p)
	}
}
