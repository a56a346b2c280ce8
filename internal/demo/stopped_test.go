package demo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/internal/natsver"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// The demo's consumer supervisor restarts the demo's own simulated crashes only: any other
// return of the consumer's Run ends the demo with that error. It restarted every return, so
// a consumer that could never start (a nats-server too old for it, a refused configuration, a
// stream gone) was restarted every 100 ms for ever, unseen.
func TestConsumerExitRestartsOnlySimulatedCrashes(t *testing.T) {
	t.Parallel()
	tooOld := &txoutbox.ServerVersionError{Component: "consumer", Feature: "the consumer", Server: "2.9.10", Required: consumer.MinServerVersion}
	bad := &txoutbox.ConfigError{Package: "consumer", Field: "Config.Stream", Reason: "is required"}
	noDead := fmt.Errorf("%w: %q (create a stream for it)", consumer.ErrNoDeadLetterStream, "txoutbox.dead.inventory")
	noStream := fmt.Errorf("consumer: create or update durable: %w", jetstream.ErrStreamNotFound)
	for _, c := range []struct {
		name              string
		err               error
		crashed, stopping bool
		restart           bool
		fatal             error
	}{
		{"simulated crash", consumer.ErrConsumeStopped, true, false, true, nil},
		{"simulated crash, Run returned nil", nil, true, false, true, nil},
		{"demo ending", nil, false, true, false, nil},
		{"demo ending during a crash", nil, true, true, false, nil},
		{"server too old", tooOld, false, false, false, txoutbox.ErrServerTooOld},
		{"configuration refused", bad, false, false, false, txoutbox.ErrInvalidConfig},
		{"no dead-letter stream", noDead, false, false, false, consumer.ErrNoDeadLetterStream},
		{"no stream", noStream, false, false, false, jetstream.ErrStreamNotFound},
		{"JetStream stopped delivering", consumer.ErrConsumeStopped, false, false, false, consumer.ErrConsumeStopped},
	} {
		restart, fatal := consumerExit(c.err, c.crashed, c.stopping)
		if restart != c.restart || (c.fatal == nil) != (fatal == nil) || (c.fatal != nil && !errors.Is(fatal, c.fatal)) {
			t.Errorf("%s (Run: %v): restart %v, error %v; want restart %v, error %v", c.name, c.err, restart, fatal, c.restart, c.fatal)
		}
	}
	if restart, fatal := consumerExit(nil, false, false); restart || fatal == nil {
		t.Errorf("Run returned nil before the demo ended, with no crash: restart %v, error %v; want the demo ended with an error", restart, fatal)
	}
}

// Against a nats-server older than the consumer needs (Debian's 2.9.10, the machine's own: the
// relay and the check-back run on it), the demo ends at once with exit status 1, naming the
// versions and what to do, and removes its streams. It hung: the relay published everything,
// the progress line said "applied 0" until the timeout, and nothing said why, even with -v.
func TestDemoEndsOnAServerTooOldForTheConsumer(t *testing.T) {
	t.Parallel()
	version, nc, js := testsvc.SystemNATS(t)
	if older, err := natsver.Less(version, consumer.MinServerVersion); err != nil || !older {
		t.Skipf("skipping: the machine's nats-server is %s, not older than the consumer's %s (%v)", version, consumer.MinServerVersion, err)
	}
	var out, errOut bytes.Buffer
	start := time.Now()
	code := Main([]string{"-database-url", testsvc.PostgresDSN(t), "-nats-url", nc.ConnectedUrl(),
		"-orders", "20", "-payments", "4", "-rate", "200", "-consumer-crash", "0", "-timeout", "45s"}, &out, &errOut)
	took := time.Since(start)
	msg := errOut.String()
	for _, want := range []string{"consumer stopped", "nats-server " + version + " is too old", consumer.MinServerVersion + " or later", "Unset NATS_URL"} {
		if code != 1 || !strings.Contains(msg, want) {
			t.Fatalf("demo on nats-server %s: exit %d after %s, stderr %q lacks %q; want exit 1 at once, saying why\n%s", version, code, took.Round(time.Millisecond), msg, want, out.String())
		}
	}
	ctx := context.Background()
	for _, name := range []string{streamName, deadStreamName} {
		if _, err := js.Stream(ctx, name); !errors.Is(err, jetstream.ErrStreamNotFound) {
			t.Errorf("stream %s after the demo: %v, want it removed", name, err)
		}
	}
	t.Logf("nats-server %s: exit %d after %s: %s", version, code, took.Round(time.Millisecond), strings.TrimSpace(msg))
}

// On a NATS whose streams already capture some of the demo's subjects, the demo says which
// streams and what to do, as it does for a stream of its own name, and leaves nothing behind.
// It printed the server's bare "nats: API error: code=400 err_code=10065 description=subjects
// overlap with an existing stream".
func TestDemoOverStreamsThatOverlap(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, c := range []struct {
		name, subject, stream string
	}{
		{"ORDERS", "orders.>", streamName},
		{"ALL_DEAD", "txoutbox.dead.>", deadStreamName},
	} {
		n := testsvc.NewNATS(t)
		n.Stream(t, c.name, c.subject)
		cfg := DefaultConfig()
		cfg.DSN, cfg.NATSURL = testsvc.PostgresDSN(t), n.URL()
		cfg.Timeout = time.Minute
		var out bytes.Buffer
		_, err := Run(ctx, cfg, &out)
		var oe *streamOverlapError
		if !errors.As(err, &oe) || oe.Stream != c.stream {
			t.Fatalf("stream %s on %s already there: %v; want a *streamOverlapError for %s\n%s", c.name, c.subject, err, c.stream, out.String())
		}
		for _, want := range []string{"cannot create stream " + c.stream, "stream " + c.name + " (" + c.subject + ") captures", "Remove or change it at NATS_URL, or unset NATS_URL"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("stream %s on %s already there: %q lacks %q", c.name, c.subject, err, want)
			}
		}
		names := []string{}
		for name := range n.JS.StreamNames(ctx).Name() {
			names = append(names, name)
		}
		if len(names) != 1 || names[0] != c.name {
			t.Errorf("streams after the demo: %q, want only %s (its own removed, the other untouched)", names, c.name)
		}
	}
}
