package checkback

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

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
	var logs testsvc.LogBuffer
	cfg := fastConfig()
	cfg.Logger = logs.LoggerAt(slog.LevelInfo)
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
		if w := logs.Lines(t, msgInconclusive, "group", group); len(w) != 1 || w[0]["level"] != "WARN" {
			t.Errorf("group %s: %d checks, %d lines saying its checks are inconclusive, want 1 warning", group, n, len(w))
		}
		if all := logs.Lines(t, "", "group", group); len(all) != 1 {
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
	if c := logs.Lines(t, msgConclusive, "group", "orders"); len(c) != 1 || c[0]["inconclusive_checks"] != float64(unknown) {
		t.Errorf("lines saying the group answers again: %v, want one counting %d inconclusive checks", c, unknown)
	}
	if w := logs.Lines(t, msgInconclusive, "group", "orders"); len(w) != 1 {
		t.Errorf("%d lines saying the group's checks are inconclusive, want still 1", len(w))
	}
}

const msgSettledElsewhere = "a producer group has no inconclusive half messages left: its producer settled them, or they became check_exhausted or were removed"

// A group's inconclusive state also ends when no half message a check found inconclusive is
// left without a COMMIT or ROLLBACK from its checker: its producer settled them (commit or
// roll back), or they became check_exhausted. One info line says so, and the group's next
// incident warns again.
func TestInconclusiveGroupEndsWhenItsRowsAreSettledElsewhere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	var logs testsvc.LogBuffer
	cfg := fastConfig()
	cfg.MaxChecks = 3
	cfg.Logger = logs.LoggerAt(slog.LevelInfo)
	cb := e.checkback(cfg)
	e.serve("orders", answer(outbox.StateUnknown))
	// until runs passes until cond holds.
	until := func(what string, cond func() bool) {
		t.Helper()
		testsvc.Eventually(t, 20*time.Second, what, func() bool {
			if _, err := cb.resolveOnce(ctx); err != nil {
				t.Fatal(err)
			}
			return cond()
		})
	}
	warnings := func() int { return len(logs.Lines(t, msgInconclusive, "group", "orders")) }
	ended := func() int { return len(logs.Lines(t, msgSettledElsewhere, "group", "orders")) }

	// 1. UNKNOWN, then the producer commits one row and rolls the other back.
	a := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders"})
	b := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders"})
	until("a warning for the group", func() bool { return warnings() == 1 })
	if err := e.client.Commit(ctx, e.db.Pool, a.ID); err != nil {
		t.Fatal(err)
	}
	if err := e.client.Rollback(ctx, e.db.Pool, b.ID); err != nil {
		t.Fatal(err)
	}
	until("the group's inconclusive state to end", func() bool { return ended() == 1 })

	// 2. A new incident warns again; its rows become check_exhausted; that ends it too.
	e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders"})
	until("a second warning for the group", func() bool { return warnings() == 2 })
	until("the row to be exhausted and the state to end", func() bool { return ended() == 2 })
	var st string
	if err := e.db.Pool.QueryRow(ctx, "SELECT state FROM txoutbox_messages WHERE state = 'check_exhausted'").Scan(&st); err != nil {
		t.Fatalf("no check_exhausted row: %v", err)
	}

	// 3. And the next incident warns again.
	e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders"})
	until("a third warning for the group", func() bool { return warnings() == 3 })
	for _, l := range logs.Lines(t, msgSettledElsewhere, "group", "orders") {
		if l["level"] != "INFO" {
			t.Errorf("line %v, want INFO", l)
		}
	}
	if n := len(logs.Lines(t, msgConclusive, "group", "orders")); n != 0 {
		t.Errorf("%d lines saying the checker answered again; it never did", n)
	}
}

// Past maxInconclusiveGroups groups, one warning says the check-back stops following further
// groups one by one; their checks are logged at debug level, not one warning per check; once
// there is room again, one info line says so.
func TestInconclusiveGroupsOverflowWarnsOnce(t *testing.T) {
	t.Parallel()
	var logs testsvc.LogBuffer
	log := logs.LoggerAt(slog.LevelInfo)
	var g inconclusiveGroups
	const groups = maxInconclusiveGroups + 50
	for round := 0; round < 3; round++ {
		for i := 0; i < groups; i++ {
			g.inconclusive(log, fmt.Sprint("g", i), OutcomeUnknown, "UNKNOWN", "group", fmt.Sprint("g", i))
		}
	}
	if n := len(logs.Lines(t, msgInconclusive)); n != maxInconclusiveGroups {
		t.Fatalf("%d warnings for %d groups × 3 checks, want one per followed group (%d)", n, groups, maxInconclusiveGroups)
	}
	if n := len(logs.Lines(t, "")); n != maxInconclusiveGroups+1 {
		t.Fatalf("%d lines, want %d warnings and one saying the rest are not followed", n, maxInconclusiveGroups)
	}
	g.conclusive(log, "g0")
	if n := len(logs.Lines(t, "the check-back follows every producer group with inconclusive checks again")); n != 1 {
		t.Fatalf("%d lines saying there is room again, want 1", n)
	}
}
