package relay

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// A relay that joins a busy relay holding every partition gets its share at once, not at the
// holder's next lease round: the holder's membership watch sees the new member and its next
// claim runs a round. The holder's lease interval here is ten minutes, so only the watch can
// make it release within the test; every message is still published exactly once.
func TestJoiningRelayGetsItsShareBeforeTheHoldersNextRound(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const holderInterval = 10 * time.Minute
	// The holder's worst republish delay grows with its lease interval: a stream whose
	// duplicate window covers it.
	if _, err := e.nats.JS.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: "SCALE", Subjects: []string{"scale.>"}, Duplicates: 4 * time.Hour,
	}); err != nil {
		t.Fatal(err)
	}
	const parts = 8
	msgs := func(from, n int) []outbox.Message {
		out := make([]outbox.Message, n)
		for i := range out {
			out[i] = outbox.Message{Subject: "scale.msg", Key: fmt.Sprintf("k%d", (from+i)%40)}
		}
		return out
	}
	e.enqueue(msgs(0, 200)...)
	a := e.start(&Config{ID: "a", Partitions: parts, LeaseInterval: holderInterval, BatchSize: 10, Subjects: []string{"scale.>"}})
	testsvc.Eventually(t, 30*time.Second, "a to hold every partition and publish", func() bool {
		return len(a.Partitions()) == parts && a.Stats().Published > 0
	})
	b := e.start(&Config{ID: "b", Partitions: parts, LeaseInterval: 100 * time.Millisecond, BatchSize: 10, Subjects: []string{"scale.>"}})
	testsvc.Eventually(t, 60*time.Second, "the shares to even out (4 and 4) long before a's next lease round", func() bool {
		return len(a.Partitions()) == parts/2 && len(b.Partitions()) == parts/2
	})
	e.enqueue(msgs(200, 200)...)
	testsvc.Eventually(t, 60*time.Second, "every message to be published", func() bool {
		return e.count("true") == 0
	})
	got := e.streamMsgs("SCALE")
	seen := map[string]bool{}
	for _, m := range got {
		id := m.Header.Get(outbox.HeaderMsgID)
		if seen[id] {
			t.Fatalf("message %s stored twice", id)
		}
		seen[id] = true
	}
	if len(seen) != 400 {
		t.Fatalf("stream holds %d distinct messages, want 400", len(seen))
	}
	if b.Stats().Published == 0 {
		t.Fatal("b published nothing after it got its share")
	}
}
