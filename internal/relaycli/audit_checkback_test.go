package relaycli

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/checkback"
)

// `relay checkback --once` says there is no ready row when there is none: it printed "oldest
// ready row: 0s", the age of a row that does not exist.
func TestAuditCheckbackOnceOldestReadyNone(t *testing.T) {
	t.Parallel()
	cfg := checkback.Config{StaleReadyAfter: time.Minute, ResolveSchedule: checkback.ScheduleOff, PurgeSchedule: checkback.ScheduleOff}
	for _, c := range []struct {
		oldest time.Duration
		want   string
	}{
		{0, "oldest ready row: none,"},
		{1500 * time.Millisecond, "oldest ready row: 1.5s,"},
	} {
		var b bytes.Buffer
		printReport(&b, &checkback.Report{Stale: checkback.StaleResult{OldestReady: c.oldest}}, &cfg)
		if out := b.String(); !strings.Contains(out, c.want) {
			t.Errorf("oldest ready %v: %q, want it to say %q", c.oldest, out, c.want)
		}
	}
}

// The failures of `relay checkback --once` count one half message or check in the singular
// and more in the plural, not "1 check(s)".
func TestAuditCheckbackOnceCountsSingular(t *testing.T) {
	t.Parallel()
	down := &conns{NATSURL: "nats://127.0.0.1:4222", NC: &nats.Conn{}} // never connected: IsConnected is false
	for _, c := range []struct {
		rep  checkback.ResolveResult
		want string
	}{
		{checkback.ResolveResult{Released: 1}, "could not check 1 half message due for a check: NATS at nats://127.0.0.1:4222 does not answer; it stays prepared,"},
		{checkback.ResolveResult{Released: 2}, "could not check 2 half messages due for a check: NATS at nats://127.0.0.1:4222 does not answer; they stay prepared,"},
		{checkback.ResolveResult{Checks: map[string]int{checkback.OutcomeNoResponders: 1}},
			"1 check of a half message got no answer from its checker (no_responders 1): "},
		{checkback.ResolveResult{Checks: map[string]int{checkback.OutcomeNoResponders: 1, checkback.OutcomeTimeout: 2}},
			"3 checks of half messages got no answer from their checker (no_responders 1, timeout 2): "},
	} {
		err := uncheckedErr(&checkback.Report{Resolve: c.rep}, down)
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "(s)") {
			t.Errorf("%+v: %v; want it to say %q", c.rep, err, c.want)
		}
	}
	if err := uncheckedErr(&checkback.Report{Resolve: checkback.ResolveResult{Checks: map[string]int{checkback.OutcomeNoResponders: 1}}}, down); !strings.Contains(err.Error(), "it counts a check, and the row stays prepared") {
		t.Errorf("one check: %v", err)
	}
}
