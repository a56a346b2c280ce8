package checkback

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// lockedBuffer is a log destination read while the check-back may write.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// lines returns the JSON log lines with msg (all when msg is empty) and, when group is set,
// that group.
func (l *lockedBuffer) lines(t *testing.T, msg, group string) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(l.b.Bytes()))
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		if (msg == "" || m["msg"] == msg) && (group == "" || m["group"] == group) {
			out = append(out, m)
		}
	}
	return out
}

const (
	msgInconclusive = "a producer group's checks are inconclusive; its half messages are checked again with backoff " +
		"(further inconclusive checks are logged at debug level until one gets COMMIT or ROLLBACK)"
	msgConclusive = "a producer group's checks are conclusive again"
)

// A checker that keeps answering UNKNOWN (and a group nobody serves) is one warning per group
// when its checks start being inconclusive, not one line per check; the checks are counted in
// the metrics, and the first COMMIT is one line saying the group answers again.
func TestInconclusiveChecksLogOncePerGroupStateChange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	var logs lockedBuffer
	cfg := fastConfig()
	cfg.Logger = slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	cb := e.checkback(cfg)
	ck := e.serve("orders", answer(outbox.StateUnknown))
	for range 3 {
		e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders"})
	}
	e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "absent"}) // nobody serves it: no responders

	unknown, absent := 0, 0
	testsvc.Eventually(t, 20*time.Second, "three UNKNOWN answers per row, and two checks of the unserved group", func() bool {
		res, err := cb.resolveOnce(ctx)
		if err != nil {
			t.Fatal(err)
		}
		unknown += res.Checks[OutcomeUnknown]
		absent += res.Checks[OutcomeNoResponders]
		return unknown >= 9 && absent >= 2
	})
	if got := counter(t, reg, "txoutbox_checkback_checks_total", OutcomeUnknown); got != float64(unknown) || len(ck.requests()) != unknown {
		t.Fatalf("checks_total{unknown} = %v, checker asked %d times; want %d", got, len(ck.requests()), unknown)
	}
	for group, n := range map[string]int{"orders": unknown, "absent": absent} {
		if w := logs.lines(t, msgInconclusive, group); len(w) != 1 || w[0]["level"] != "WARN" {
			t.Errorf("group %s: %d checks, %d lines saying its checks are inconclusive, want 1 warning", group, n, len(w))
		}
		if all := logs.lines(t, "", group); len(all) != 1 {
			t.Errorf("group %s: %d log lines at info level or above for %d inconclusive checks, want 1: %v", group, len(all), n, all)
		}
	}

	ck.setAnswer(answer(outbox.StateCommit))
	committed := 0
	testsvc.Eventually(t, 10*time.Second, "the checker's COMMIT to settle the rows", func() bool {
		res, err := cb.resolveOnce(ctx)
		if err != nil {
			t.Fatal(err)
		}
		committed += res.Committed
		return committed == 3
	})
	if c := logs.lines(t, msgConclusive, "orders"); len(c) != 1 || c[0]["inconclusive_checks"] != float64(unknown) {
		t.Errorf("lines saying the group answers again: %v, want one counting %d inconclusive checks", c, unknown)
	}
	if w := logs.lines(t, msgInconclusive, "orders"); len(w) != 1 {
		t.Errorf("%d lines saying the group's checks are inconclusive, want still 1", len(w))
	}
}
