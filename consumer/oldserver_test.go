package consumer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/natsver"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// On the machine's own nats-server (Debian's, 2.9 here: older than MinServerVersionTermReason,
// which ignores a terminate that carries a reason), a dead-lettered message is terminated for
// good: its handler ran once, the durable's ack floor passes it and nothing is redelivered —
// not dead-lettered again after every AckWait.
func TestDeadLetterTerminatesOnTheSystemServer(t *testing.T) {
	t.Parallel()
	version, _, js := testsvc.SystemNATS(t)
	t.Logf("nats-server %s (term with a reason: %v)", version, !lessVersion(version, MinServerVersionTermReason))
	ctx := context.Background()
	for name, subjects := range map[string]string{testStream: "orders.>", deadStream: DefaultDeadLetterPrefix + ">"} {
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subjects}, Duplicates: 2 * time.Minute}); err != nil {
			t.Fatal(err)
		}
	}
	db := testsvc.NewDB(t)
	calls := make(chan string, 16)
	c, err := New(db.Pool, js, func(_ context.Context, _ pgx.Tx, msg Message) error {
		calls <- string(msg.Data)
		return Permanent(errors.New("poison"))
	}, &Config{Stream: testStream, Durable: testDurable, Schema: db.Schema, AckWait: 500 * time.Millisecond,
		Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg("orders.created")
	m.Header.Set(outbox.HeaderMsgID, newID())
	m.Data = []byte("poison")
	ack, err := js.PublishMsg(ctx, m)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	defer func() {
		cancel()
		<-done
	}()
	testsvc.Eventually(t, 20*time.Second, "the message terminated: the ack floor past it, nothing pending", func() bool {
		cons, err := js.Consumer(ctx, testStream, testDurable)
		if err != nil {
			return false
		}
		info, err := cons.Info(ctx)
		return err == nil && info.AckFloor.Stream >= ack.Sequence && info.NumAckPending == 0 && info.NumRedelivered == 0
	})
	if n := len(calls); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
	if st := c.Stats(); st.DeadLettered != 1 {
		t.Fatalf("dead-lettered %d times, want 1", st.DeadLettered)
	}
}

func lessVersion(a, b string) bool {
	less, err := natsver.Less(a, b)
	return err == nil && less
}
