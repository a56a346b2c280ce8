package relaycli

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// relay run refuses to start on a stream it cannot publish to: it exits 1 at once (no wait)
// with a message naming the stream, the subject and the setting.
func TestRunRefusesNoAckStream(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	if _, err := n.JS.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: "NOACK", Subjects: []string{"noack.>"}, NoAck: true, Duplicates: 2 * time.Minute,
	}); err != nil {
		t.Fatal(err)
	}
	code, _, errOut := cli(t, "run", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema,
		"--subjects", "noack.>", "--no-checkback")
	if code != 1 || !strings.Contains(errOut, "relay run: relay: stream unusable") ||
		!strings.Contains(errOut, `"NOACK"`) || !strings.Contains(errOut, `"noack.>"`) || !strings.Contains(errOut, "no_ack") {
		t.Fatalf("relay run on a no_ack stream: exit %d, stderr:\n%s\nwant exit 1 naming NOACK, noack.> and no_ack", code, errOut)
	}
}
