package consumer

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// vandal is a handler's side that records what each call was given, then changes all of it:
// every payload byte, every header value, one name's values appended to, one header deleted,
// one added. It also keeps what it was given, and changes it once more after the next call.
type vandal struct {
	mu   sync.Mutex
	seen map[string][]string // payload as published → what each call saw
	kept []Message
}

// snapshot is msg's payload and headers, deep, in a stable text.
func snapshot(data []byte, h nats.Header) string {
	names := slices.Sorted(maps.Keys(h))
	var b strings.Builder
	fmt.Fprintf(&b, "data=%q", data)
	for _, k := range names {
		fmt.Fprintf(&b, " %s=%q", k, h[k])
	}
	return b.String()
}

// wreck records msg (by name, the payload as it should be: the idempotency key's prefix)
// and changes everything it was given.
func (v *vandal) wreck(msg Message) {
	name := strings.SplitN(msg.IdempotencyKey, "/", 2)[0]
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.seen == nil {
		v.seen = map[string][]string{}
	}
	v.seen[name] = append(v.seen[name], snapshot(msg.Payload, msg.Headers))
	for _, old := range v.kept { // what an earlier call kept, changed after its call
		for i := range old.Payload {
			old.Payload[i] = 'L'
		}
		old.Headers["X-Late"] = []string{"late"}
	}
	for i := range msg.Payload {
		msg.Payload[i] = 'X'
	}
	for k, vs := range msg.Headers {
		for i := range vs {
			vs[i] = "mutated"
		}
		msg.Headers[k] = append(vs, "appended")
	}
	delete(msg.Headers, "X-Delete-Me")
	msg.Headers["X-Injected"] = []string{"by the handler"}
	v.kept = append(v.kept, msg)
}

func (v *vandal) calls(name string) []string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return append([]string(nil), v.seen[name]...)
}

// published is a message as published: its name is its payload.
type published struct {
	name    string
	headers nats.Header
}

// publishAll publishes each name as a message with a few headers of its own (one of them the
// handler deletes), keyed by key when set; Nats-Msg-Id is name/uuid.
func (e *env) publishAll(key string, names ...string) map[string]published {
	e.t.Helper()
	out := map[string]published{}
	for _, n := range names {
		h := nats.Header{
			outbox.HeaderMsgID: {n + "/" + newID()},
			"X-Tenant":         {"acme", "second value"},
			"X-Delete-Me":      {"keep me"},
			"traceparent":      {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
		}
		if key != "" {
			h[outbox.HeaderKey] = []string{key}
		}
		e.publish("orders.created", h, n)
		out[n] = published{name: n, headers: h}
	}
	return out
}

// checkPristine fails unless every handler call saw its message as published, at least
// minCalls[name] times, and every dead letter carries its message as published: the payload,
// and every header but Nats-* (Nats-Msg-Id as Txoutbox-Dead-Msg-Id), nothing the handler
// added.
func (e *env) checkPristine(v *vandal, msgs map[string]published, minCalls map[string]int, deadNames ...string) {
	e.t.Helper()
	for name, p := range msgs {
		want := snapshot([]byte(name), p.headers)
		calls := v.calls(name)
		if len(calls) < minCalls[name] {
			e.t.Errorf("%s: the handler ran %d times, want at least %d (the rerun this test is about did not happen)", name, len(calls), minCalls[name])
		}
		for i, got := range calls {
			if got != want {
				e.t.Errorf("%s: handler call %d saw\n  %s\nwant it as published\n  %s", name, i+1, got, want)
			}
		}
	}
	dead := e.deadLetters()
	var got []string
	for _, m := range dead {
		got = append(got, string(m.Data))
	}
	sort.Strings(got)
	sort.Strings(deadNames)
	if !slices.Equal(got, deadNames) {
		e.t.Errorf("dead letters %q, want %q", got, deadNames)
	}
	for _, m := range dead {
		p, ok := msgs[string(m.Data)]
		if !ok {
			continue // its payload changed: reported above
		}
		for k, vs := range p.headers {
			if k == outbox.HeaderMsgID {
				if m.Header.Get(HeaderDeadMsgID) != vs[0] {
					e.t.Errorf("%s: dead letter's %s %q, want %q", p.name, HeaderDeadMsgID, m.Header.Get(HeaderDeadMsgID), vs[0])
				}
				continue
			}
			if !slices.Equal(m.Header[k], vs) {
				e.t.Errorf("%s: dead letter's %s is %q, want %q", p.name, k, m.Header[k], vs)
			}
		}
		for _, k := range []string{"X-Injected", "X-Late"} {
			if _, ok := m.Header[k]; ok {
				e.t.Errorf("%s: dead letter has the handler's header %s", p.name, k)
			}
		}
	}
}

// A handler that changes everything it is given (payload bytes, header values and names),
// and changes it again after its call, affects neither a later run of a handler with the same
// message nor its dead letter, in every mode that runs a handler again without a redelivery.
func TestHandlerChangesStayInTheCall(t *testing.T) {
	t.Parallel()
	poison := errors.New("poison")

	// Per-message mode: the dead letter.
	t.Run("per-message", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		var v vandal
		c := e.newConsumer(nil, nil, func(ctx context.Context, tx pgx.Tx, msg Message) error {
			v.wreck(msg)
			if strings.HasPrefix(msg.IdempotencyKey, "B/") {
				return Permanent(poison)
			}
			return nil
		})
		msgs := e.publishAll("", "A", "B")
		e.run(c)
		testsvc.Eventually(t, 20*time.Second, "the dead letter", func() bool { return len(e.deadLetters()) == 1 })
		testsvc.Eventually(t, 20*time.Second, "A processed", func() bool { return c.Stats().Processed == 1 })
		e.checkPristine(&v, msgs, map[string]int{"A": 1, "B": 1}, "B")
	})

	// Batch mode: B fails in the fast path, so A runs again in the savepoint path; B is
	// dead-lettered.
	t.Run("batch savepoint rerun", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		var v vandal
		c := e.newConsumer(nil, &Config{BatchSize: 2, Concurrency: 1}, func(ctx context.Context, tx pgx.Tx, msg Message) error {
			v.wreck(msg)
			if strings.HasPrefix(msg.IdempotencyKey, "B/") {
				return Permanent(poison)
			}
			return nil
		})
		msgs := e.publishAll("", "A", "B")
		its := e.items(c, 2)
		c.handleBatch(context.Background(), its)
		e.checkPristine(&v, msgs, map[string]int{"A": 2, "B": 1}, "B")
	})

	// A batch handler: the batch fails (no message named), is split, and B, alone, is
	// dead-lettered; A and C run again in the halves.
	t.Run("batch handler split", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		var v vandal
		c := e.newBatchConsumer(&Config{BatchSize: 10}, func(ctx context.Context, tx pgx.Tx, msgs []Message) error {
			bad := false
			for _, m := range msgs {
				bad = bad || strings.HasPrefix(m.IdempotencyKey, "B/")
				v.wreck(m)
			}
			if bad {
				return Permanent(poison)
			}
			return nil
		})
		msgs := e.publishAll("", "A", "B", "C")
		its := e.items(c, 3)
		c.handleBatch(context.Background(), its)
		e.checkPristine(&v, msgs, map[string]int{"A": 2, "B": 2, "C": 2}, "B")
	})

	// Ordered mode: a keyed message that fails is retried in place (the same delivery); it
	// fails again with a permanent error and is dead-lettered. With pgx and database/sql.
	for _, driver := range []string{"pgx pool", "database/sql"} {
		t.Run("ordered in-place retry/"+driver, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			var v vandal
			var mu sync.Mutex
			runs := 0
			fail := func(msg Message) error {
				v.wreck(msg)
				mu.Lock()
				defer mu.Unlock()
				runs++
				if runs == 1 {
					return errors.New("transient")
				}
				return Permanent(poison)
			}
			cfg := &Config{Ordered: true, MaxDeliveries: 5}
			var c *Consumer
			if driver == "database/sql" {
				c = e.newSQLConsumer(e.openSQL("pgx"), cfg, func(ctx context.Context, tx *sql.Tx, msg Message) error { return fail(msg) })
			} else {
				c = e.newConsumer(nil, cfg, func(ctx context.Context, tx pgx.Tx, msg Message) error { return fail(msg) })
			}
			msgs := e.publishAll("acct-1", "A")
			e.run(c)
			testsvc.Eventually(t, 20*time.Second, "the dead letter", func() bool { return len(e.deadLetters()) == 1 })
			if n := e.consumerInfo(testDurable).NumRedelivered; n != 0 {
				t.Errorf("%d redeliveries: the retry was not in place", n)
			}
			e.checkPristine(&v, msgs, map[string]int{"A": 2}, "A")
		})
	}

	// database/sql, per message: the dead letter.
	t.Run("database/sql", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		var v vandal
		c := e.newSQLConsumer(e.openSQL("pgx"), nil, func(ctx context.Context, tx *sql.Tx, msg Message) error {
			v.wreck(msg)
			return Permanent(poison)
		})
		msgs := e.publishAll("", "B")
		e.run(c)
		testsvc.Eventually(t, 20*time.Second, "the dead letter", func() bool { return len(e.deadLetters()) == 1 })
		e.checkPristine(&v, msgs, map[string]int{"B": 1}, "B")
	})
}

// handlerCopy gives each call its own payload and header slices, and leaves nil as nil.
func TestHandlerCopy(t *testing.T) {
	m := Message{Payload: []byte("abc"), Headers: nats.Header{"A": {"1", "2"}, "B": {"3"}, "Nil": nil, "Empty": {}}}
	c := m.handlerCopy()
	c.Payload[0] = 'X'
	c.Headers["A"][0] = "x"
	c.Headers["A"] = append(c.Headers["A"], "appended")
	c.Headers["B"] = append(c.Headers["B"], "appended") // must not spill into another name's values
	delete(c.Headers, "Nil")
	c.Headers["New"] = []string{"n"}
	if string(m.Payload) != "abc" || snapshot(m.Payload, m.Headers) != snapshot([]byte("abc"), nats.Header{"A": {"1", "2"}, "B": {"3"}, "Nil": nil, "Empty": {}}) {
		t.Fatalf("the original changed: %s", snapshot(m.Payload, m.Headers))
	}
	if got := snapshot(c.Payload, c.Headers); !strings.Contains(got, `A=["x" "2" "appended"]`) || !strings.Contains(got, `B=["3" "appended"]`) {
		t.Fatalf("copy %s", got)
	}
	var empty Message
	if c := empty.handlerCopy(); c.Payload != nil || c.Headers != nil {
		t.Fatalf("a message without payload or headers copied as %#v", c)
	}
	if c := (Message{Headers: nats.Header{"Nil": nil}}).handlerCopy(); c.Headers["Nil"] != nil {
		t.Fatalf("a nil value list copied as %#v", c.Headers["Nil"])
	}
}
