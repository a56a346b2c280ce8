package relay

import (
	"context"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/outbox"
)

// A core NATS service that answers on a subject no stream captures (a request/reply service,
// a checker) makes that subject's publishes fail — counted attempts, a last_error that says
// so — and is never taken for a broker outage: the other subjects' rows are published, the
// relay does not back off, and its health stays ok.
func TestCoreResponderFailsItsSubjectOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	sub, err := e.nats.Conn.Subscribe("svc.echo", func(m *nats.Msg) { _ = m.Respond([]byte("hello")) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := e.nats.Conn.Flush(); err != nil {
		t.Fatal(err)
	}
	e.enqueue(outbox.Message{Subject: "svc.echo", Key: "k", Payload: []byte("svc")})
	e.enqueue(outbox.Message{Subject: "orders.created", Payload: []byte("healthy")})
	r := e.relay(nil)
	if _, err := r.runOnce(ctx); err != nil {
		t.Fatalf("runOnce: %v (a subject's own failure is not the broker's)", err)
	}
	row := e.row("svc")
	if row.state != "ready" || row.attempts != 1 || !strings.Contains(row.lastErr, "core NATS responder") {
		t.Fatalf("svc row: %+v; want ready with one attempt and a last_error naming the responder", row)
	}
	if got := payloads(e.streamMsgs("ORDERS")); got != "healthy" {
		t.Fatalf("ORDERS holds %q, want the healthy row", got)
	}
	if h := r.Health(); h == HealthNATSUnavailable {
		t.Fatalf("health %s after a subject's own failure", h)
	}
}
