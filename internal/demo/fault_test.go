package demo

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/fault"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// killedBy reports whether a child process died of SIGKILL at a fault point.
func killedAt(t *testing.T, err error, output, point string) {
	t.Helper()
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("the child did not die (err %v):\n%s", err, output)
	}
	if ws, ok := ee.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("the child exited with %v, want death by SIGKILL:\n%s", ee, output)
	}
	if !strings.Contains(output, fault.KillMarker+point) {
		t.Fatalf("the child's output does not name the fault point %s:\n%s", point, output)
	}
}

// The relay's fault point sits between publish and settle: a relay binary armed with it is
// killed after the stream stored the batch and before the outbox rows were settled. The next
// relay publishes them again and JetStream's duplicate window keeps one copy of each.
func TestRelayFaultPointBetweenPublishAndSettle(t *testing.T) {
	t.Parallel()
	bin := relayBinary(t)
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	n.Stream(t, "FP", "fp.>")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	const msgs = 5
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		for i := range msgs {
			if _, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "fp.x", Payload: []byte{byte(i)}}); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	args := []string{"run", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema, "--subjects", "fp.>",
		"--no-checkback", "--poll-max", "50ms", "--relay-id", "fault-test"}

	out, err := exec.CommandContext(ctx, bin, append(args, "--fault", fault.RelayBeforeSettle+"=1")...).CombinedOutput()
	killedAt(t, err, string(out), fault.RelayBeforeSettle)
	stored := len(testsvc.StreamMsgs(t, n.JS, "FP"))
	var ready int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages WHERE state = 'ready'`).Scan(&ready); err != nil {
		t.Fatal(err)
	}
	if stored != msgs || ready != msgs {
		t.Fatalf("after the kill: %d messages stored, %d rows ready; want %d and %d (published, not settled)", stored, ready, msgs, msgs)
	}

	// A healthy relay settles them; the stream still holds each once.
	relay := exec.CommandContext(ctx, bin, args...)
	var logs strings.Builder
	relay.Stdout, relay.Stderr = &logs, &logs
	if err := relay.Start(); err != nil {
		t.Fatal(err)
	}
	testsvc.Eventually(t, time.Minute, "the outbox to be empty", func() bool {
		var left int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages`).Scan(&left)
		return left == 0
	})
	_ = relay.Process.Signal(syscall.SIGTERM)
	if err := relay.Wait(); err != nil {
		t.Errorf("relay: %v\n%s", err, logs.String())
	}
	if got := len(testsvc.StreamMsgs(t, n.JS, "FP")); got != msgs {
		t.Fatalf("after the republish the stream holds %d messages, want %d", got, msgs)
	}
}

// The consumer's fault point sits between commit and ack: a consumer process armed with it
// dies with the effect committed and the message unacked. The next one gets the redelivery,
// finds the dedup row and only acks it: one effect.
func TestConsumerFaultPointBetweenCommitAndAck(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, businessDDL); err != nil {
			return err
		}
		return (&businessSetup{SKUs: 1}).seed(ctx, tx)
	}); err != nil {
		t.Fatal(err)
	}
	if err := createStreams(ctx, n.JS); err != nil {
		t.Fatal(err)
	}
	body, _ := json.Marshal(orderEvent{OrderID: 1, Customer: "c", SKU: "sku-1", Qty: 3})
	msg := nats.NewMsg(orderSubject)
	msg.Header.Set(outbox.HeaderMsgID, uuid.NewString())
	msg.Header.Set(outbox.HeaderBizKey, "order:1")
	msg.Data = body
	if _, err := n.JS.PublishMsg(ctx, msg); err != nil {
		t.Fatal(err)
	}
	args := []string{"-database-url", db.DSN, "-nats-url", n.URL(), "-schema", db.Schema, "-ack-wait", "1s"}
	counts := func() (effects, stock, ackPending int64) {
		t.Helper()
		if err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM demo_effects), (SELECT stock FROM demo_inventory)`).Scan(&effects, &stock); err != nil {
			t.Fatal(err)
		}
		c, err := n.JS.Consumer(ctx, streamName, durableName)
		if err != nil {
			t.Fatal(err)
		}
		info, err := c.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return effects, stock, int64(info.NumAckPending)
	}

	out, err := consumerChild(ctx, t, append(args, "-fault", fault.ConsumerAfterCommit+"=1")...).CombinedOutput()
	killedAt(t, err, string(out), fault.ConsumerAfterCommit)
	if effects, stock, pending := counts(); effects != 1 || stock != initialStock-3 || pending != 1 {
		t.Fatalf("after the kill: %d effects, stock %d, %d unacked; want 1, %d, 1 (committed, not acked)", effects, stock, pending, initialStock-3)
	}

	// A healthy consumer gets the redelivery and recognises it.
	child := consumerChild(ctx, t, args...)
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	child.Stderr = &stderr
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	sawDuplicate := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		found := false
		for sc.Scan() {
			if st, ok := parseStats(sc.Text()); ok && st[1] >= 1 && !found {
				found = true
				sawDuplicate <- true
			}
		}
		if !found {
			sawDuplicate <- false
		}
	}()
	select {
	case ok := <-sawDuplicate:
		if !ok {
			t.Fatalf("the consumer exited without reporting a duplicate: %s", stderr.String())
		}
	case <-ctx.Done():
		t.Fatal("no duplicate reported")
	}
	_ = child.Process.Signal(syscall.SIGTERM)
	if err := child.Wait(); err != nil {
		t.Errorf("consumer: %v\n%s", err, stderr.String())
	}
	if effects, stock, pending := counts(); effects != 1 || stock != initialStock-3 || pending != 0 {
		t.Fatalf("after the redelivery: %d effects, stock %d, %d unacked; want 1, %d, 0", effects, stock, pending, initialStock-3)
	}
}
