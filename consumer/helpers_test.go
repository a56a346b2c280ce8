package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

func TestMain(m *testing.M) { os.Exit(testsvc.ExampleMain(m)) }

// The examples read TXOUTBOX_SCHEMA as a service does; unset, they must work in the default
// schema too.
func TestExamplesInDefaultSchema(t *testing.T) { testsvc.RunExamplesInDefaultSchema(t) }

const (
	testStream  = "ORDERS"
	deadStream  = "DEAD"
	testDurable = "billing"
)

type env struct {
	t    *testing.T
	db   *testsvc.DB
	nats *testsvc.NATS
}

// newEnv gives the test its own schema (with an effects table recording every business
// effect, deliberately without a unique key) and its own JetStream with the ORDERS stream and
// a DEAD stream for dead letters.
func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{t: t, db: testsvc.NewDB(t), nats: testsvc.NewNATS(t)}
	e.nats.Stream(t, testStream, "orders.>")
	e.nats.Stream(t, deadStream, DefaultDeadLetterPrefix+">")
	e.exec(`CREATE TABLE effects (
		id       bigserial PRIMARY KEY,
		idem     text NOT NULL,
		subject  text NOT NULL,
		payload  text NOT NULL,
		delivery int  NOT NULL,
		note     text
	)`)
	return e
}

func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.db.Pool.Exec(context.Background(), sql, args...); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
}

func quietLogger() *slog.Logger { return testsvc.Logger() }

// config is a fast test configuration: short ack wait and backoffs.
func (e *env) config(cfg *Config) *Config {
	if cfg == nil {
		cfg = &Config{}
	}
	cfg.Stream = testStream
	if cfg.Durable == "" {
		cfg.Durable = testDurable
	}
	cfg.Schema = e.db.Schema
	if cfg.AckWait == 0 {
		cfg.AckWait = time.Second
	}
	if cfg.BackoffBase == 0 {
		cfg.BackoffBase = 20 * time.Millisecond
	}
	if cfg.BackoffMax == 0 {
		cfg.BackoffMax = 200 * time.Millisecond
	}
	if cfg.StopTimeout == 0 {
		cfg.StopTimeout = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	return cfg
}

// newConsumer builds a consumer on e's JetStream (or js when given).
func (e *env) newConsumer(js jetstream.JetStream, cfg *Config, h Handler) *Consumer {
	e.t.Helper()
	if js == nil {
		js = e.nats.JS
	}
	c, err := New(e.db.Pool, js, h, e.config(cfg))
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

// run starts c.Run; the returned function stops it and returns Run's error. The test's
// cleanup stops it too.
func (e *env) run(c *Consumer) (stop func() error) {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				err = errors.New("Run did not return within 30s of its stop")
			}
		})
		return err
	}
	e.t.Cleanup(func() { _ = stop() })
	return stop
}

// publish stores a message in the ORDERS stream with exactly the given headers.
func (e *env) publish(subject string, headers map[string][]string, data string) *jetstream.PubAck {
	e.t.Helper()
	m := nats.NewMsg(subject)
	for k, v := range headers {
		m.Header[k] = v // as given: no canonicalisation
	}
	m.Data = []byte(data)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ack, err := e.nats.JS.PublishMsg(ctx, m)
	if err != nil {
		e.t.Fatalf("publish %s: %v", subject, err)
	}
	return ack
}

// publishID publishes a message as the relay would: Nats-Msg-Id = id.
func (e *env) publishID(subject, id, data string) *jetstream.PubAck {
	e.t.Helper()
	return e.publish(subject, map[string][]string{outbox.HeaderMsgID: {id}}, data)
}

// recordEffect is the standard handler: one business row per call.
func recordEffect(ctx context.Context, tx pgx.Tx, msg Message) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (idem, subject, payload, delivery) VALUES ($1, $2, $3, $4)`,
		msg.IdempotencyKey, msg.Subject, string(msg.Payload), msg.Delivery)
	return err
}

func (e *env) count(sql string, args ...any) int {
	e.t.Helper()
	var n int
	if err := e.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func (e *env) effects() int { return e.count(`SELECT count(*) FROM effects`) }

func (e *env) effectsOf(idem string) int {
	return e.count(`SELECT count(*) FROM effects WHERE idem = $1`, idem)
}

// waitEffects waits until the effects table holds at least n rows, then fails if it holds
// more (an effect applied twice by then). It does not wait for a late duplicate: tests that
// must rule one out wait for the acks (NumAckPending 0) and check the effects again.
func (e *env) waitEffects(n int) {
	e.t.Helper()
	testsvc.Eventually(e.t, 20*time.Second, "effects", func() bool { return e.effects() >= n })
	if got := e.effects(); got != n {
		e.t.Fatalf("effects: got %d, want %d", got, n)
	}
}

// deadLetters returns the DEAD stream's messages.
func (e *env) deadLetters() []*jetstream.RawStreamMsg {
	e.t.Helper()
	return testsvc.StreamMsgs(e.t, e.nats.JS, deadStream)
}

// consumerInfo returns the durable's state.
func (e *env) consumerInfo(durable string) *jetstream.ConsumerInfo {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cons, err := e.nats.JS.Consumer(ctx, testStream, durable)
	if err != nil {
		e.t.Fatal(err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	return info
}

// fetch pulls n messages from the consumer's durable (created by Setup).
func (e *env) fetch(c *Consumer, n int) []jetstream.Msg {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cons, err := c.Setup(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	var out []jetstream.Msg
	testsvc.Eventually(e.t, 10*time.Second, fmt.Sprintf("%d messages fetched", n), func() bool {
		b, err := cons.Fetch(n-len(out), jetstream.FetchMaxWait(time.Second))
		if err != nil {
			e.t.Fatal(err)
		}
		for m := range b.Messages() {
			out = append(out, m)
		}
		return len(out) >= n
	})
	if len(out) != n {
		e.t.Fatalf("fetched %d messages, want %d", len(out), n)
	}
	return out
}

func newID() string { return uuid.NewString() }
