package relay

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/txoutbox/txoutbox/outbox"
)

// A stream the relay publishes to without having checked it at start (no Config.Subjects) is
// checked once a PubAck names it: a duplicate window shorter than RequiredDuplicateWindow is a
// warning, once, and txoutbox_relay_stream_window_short{stream} 1; once the window is long
// enough again (looked at every windowRecheck), an info line and 0. Without Subjects the relay
// says at start that nothing was checked.
func TestWindowOfStreamsPublishedToIsChecked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	logs := &recordLog{}
	cfg := &Config{Logger: slog.New(logs), Registerer: prometheus.NewRegistry(), SampleInterval: time.Hour}
	required := cfg.RequiredDuplicateWindow()
	e.setDuplicateWindow(required - time.Second)
	r := e.relay(cfg)
	e.enqueue(outbox.Message{Subject: "orders.created", Payload: []byte("1")})
	if n, err := r.runOnce(ctx); n != 1 || err != nil {
		t.Fatalf("runOnce = %d, %v; want 1 published", n, err)
	}
	r.checkWindows(ctx)
	r.checkWindows(ctx) // a second look at a stream not due again says nothing more
	const short = "a stream the relay publishes to keeps duplicates for less than the relay may republish: " +
		"a republish past its window is stored twice (the consumer's dedup absorbs it); raise its duplicate window, " +
		"or lower PublishTimeout, PollMax, BackoffMax, HandoverAfter or LeaseInterval"
	if n := logs.countMsg(slog.LevelWarn, short); n != 1 {
		t.Fatalf("%d short-window warnings, want 1", n)
	}
	if g := testutil.ToFloat64(r.m.windowShort.WithLabelValues("ORDERS")); g != 1 {
		t.Fatalf("stream_window_short{ORDERS} = %v, want 1", g)
	}
	// Fixed: seen at the next look (back-dated: the recheck is due).
	e.setDuplicateWindow(required)
	r.windows.mu.Lock()
	r.windows.streams["ORDERS"].checked = time.Now().Add(-windowRecheck)
	r.windows.mu.Unlock()
	r.checkWindows(ctx)
	if g := testutil.ToFloat64(r.m.windowShort.WithLabelValues("ORDERS")); g != 0 {
		t.Fatalf("stream_window_short{ORDERS} after the fix = %v, want 0", g)
	}
	if n := logs.countMsg(slog.LevelInfo, "a stream's duplicate window is long enough again"); n != 1 {
		t.Fatalf("%d 'long enough again' lines, want 1", n)
	}
	if n := logs.countMsg(slog.LevelWarn, short); n != 1 {
		t.Fatalf("%d short-window warnings after the fix, want still 1", n)
	}
	// A stream deleted is forgotten with its series (a short window's alert would fire for
	// ever), and checked again if a PubAck names it again.
	e.setDuplicateWindow(required - time.Second)
	r.windows.mu.Lock()
	r.windows.streams["ORDERS"].checked = time.Now().Add(-windowRecheck)
	r.windows.mu.Unlock()
	r.checkWindows(ctx)
	if g := testutil.ToFloat64(r.m.windowShort.WithLabelValues("ORDERS")); g != 1 {
		t.Fatalf("stream_window_short{ORDERS} shortened again = %v, want 1", g)
	}
	if err := e.nats.JS.DeleteStream(ctx, "ORDERS"); err != nil {
		t.Fatal(err)
	}
	r.windows.mu.Lock()
	r.windows.streams["ORDERS"].checked = time.Now().Add(-windowRecheck)
	r.windows.mu.Unlock()
	r.checkWindows(ctx)
	if n := testutil.CollectAndCount(r.m.windowShort); n != 0 {
		t.Fatalf("%d stream_window_short series after the stream was deleted, want none", n)
	}
	if due := r.windows.due(time.Now().Add(windowRecheck)); len(due) != 0 {
		t.Fatalf("streams still watched after the deletion: %v", due)
	}
	r.windows.note("ORDERS")
	if due := r.windows.due(time.Now()); len(due) != 1 {
		t.Fatalf("a stream named by a PubAck again is not checked: due %v", due)
	}
}

// With Config.Subjects, CheckStreams checks the windows at start, and the streams it checked
// are not looked at again until windowRecheck.
func TestWindowCheckedAtStartIsNotDueAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	r := e.relay(&Config{Subjects: []string{"orders.>"}})
	if err := r.CheckStreams(ctx); err != nil {
		t.Fatal(err)
	}
	if due := r.windows.due(time.Now()); len(due) != 0 {
		t.Fatalf("streams due right after the start check: %v, want none", due)
	}
	if due := r.windows.due(time.Now().Add(windowRecheck)); len(due) != 1 || due[0] != "ORDERS" {
		t.Fatalf("streams due after windowRecheck: %v, want [ORDERS]", due)
	}
}
