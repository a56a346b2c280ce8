package relaycli

import (
	"context"
	"net/url"
	"strings"
	"syscall"
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

// relay run refuses a stream that takes smaller messages than the producers may enqueue
// (--max-message-bytes, the producers' default): a message between the two limits would be
// accepted and could never be published. Told the producers' real limit, it starts.
func TestRunRefusesStreamSmallerThanProducersLimit(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	if _, err := n.JS.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: "SMALL", Subjects: []string{"small.>"}, MaxMsgSize: 4096, Duplicates: 2 * time.Minute,
	}); err != nil {
		t.Fatal(err)
	}
	code, _, errOut := cli(t, "run", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema,
		"--subjects", "small.>", "--no-checkback")
	for _, want := range []string{"relay run: relay: message limit below the producers'", `"SMALL"`, `"small.>"`, "max_msg_size 4096", "1048576", "--max-message-bytes"} {
		if code != 1 || !strings.Contains(errOut, want) {
			t.Fatalf("relay run on a stream with max_msg_size 4096: exit %d, stderr:\n%s\nwant exit 1 saying %q", code, errOut, want)
		}
	}
	code, _, errOut = cli(t, "run", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema,
		"--subjects", "small.>", "--no-checkback", "--max-message-bytes", "1023")
	if code != 2 || !strings.Contains(errOut, "--max-message-bytes") {
		t.Fatalf("--max-message-bytes 1023: exit %d, want 2 naming the setting:\n%s", code, errOut)
	}
	// Told the Go producers' limit, it still refuses while the SQL producers may enqueue 1 MiB
	// (txoutbox.max_message_bytes unset); with that setting lowered too, it starts.
	code, _, errOut = cli(t, "run", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema,
		"--subjects", "small.>", "--no-checkback", "--max-message-bytes", "4096")
	if code != 1 || !strings.Contains(errOut, "up to 1048576 bytes (the database's txoutbox.max_message_bytes)") {
		t.Fatalf("--max-message-bytes 4096 with the SQL producers' limit unset: exit %d, want 1 naming the database's setting:\n%s", code, errOut)
	}
	u, err := url.Parse(db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("options", "-c txoutbox.max_message_bytes=4096")
	u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20")
	p := startRelay(t, "relay", "run", "--database-url", u.String(), "--nats-url", n.URL(), "--schema", db.Schema,
		"--subjects", "small.>", "--no-checkback", "--max-message-bytes", "4096", "--log-format", "json")
	p.waitLog(t, "relay started", 30*time.Second)
	if code := p.stop(t, syscall.SIGTERM); code != 0 {
		t.Fatalf("relay run --max-message-bytes 4096: exit %d:\n%s", code, p.output())
	}
}
