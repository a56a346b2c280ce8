package consumer

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"
)

// A stop during the start-up check of the key-order table, by cancellation or by the
// deadline of Run's ctx, is returned as the ctx's error and logs nothing: it is not the
// database failing to answer.
func TestKeyOrderCheckStoppedByItsContextIsQuiet(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var buf bytes.Buffer
	c := e.newConsumer(nil, &Config{Ordered: true, Logger: slog.New(slog.NewTextHandler(&buf, nil))}, recordEffect)
	past, cancelPast := context.WithDeadline(context.Background(), time.Unix(0, 0))
	defer cancelPast()
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for name, ctx := range map[string]context.Context{"deadline": past, "cancelled": cancelled} {
		err := c.checkTables(ctx)
		if !errors.Is(err, ctx.Err()) {
			t.Fatalf("%s: checkKeyOrderTable = %v, want the ctx's error %v", name, err, ctx.Err())
		}
	}
	if buf.Len() != 0 {
		t.Fatalf("logged on a stopped ctx:\n%s", buf.String())
	}
}
