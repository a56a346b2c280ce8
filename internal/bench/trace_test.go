package bench

import (
	"math"
	"testing"
)

// drain --trace drains the same backlog again with tracing on, checks that stream too, and
// reports the traced rate, its cost and the publish spans exported (one per message).
func TestDrainTraceSmall(t *testing.T) {
	t.Parallel()
	code, kv, log := runBench(t, "drain", "--msgs", "600", "--per-tx", "100", "--keys", "3", "--skip-ceiling", "--trace")
	if code != ExitOK {
		t.Fatalf("exit %d\n%s", code, log)
	}
	if kv["publish_spans"] != "600" || kv["traced_lost"] != "0" || kv["traced_duplicates"] != "0" {
		t.Fatalf("final line %v: want 600 publish spans, nothing lost or duplicated", kv)
	}
	relay, traced := num(t, kv, "relay_msgs_per_s"), num(t, kv, "traced_relay_msgs_per_s")
	if relay <= 0 || traced <= 0 {
		t.Fatalf("rates relay=%v traced=%v", relay, traced)
	}
	if cost, want := num(t, kv, "trace_cost"), 1-traced/relay; math.Abs(cost-want) > 0.01*max(1, math.Abs(want)) {
		t.Fatalf("trace_cost %v, want 1 - traced/relay = %v", cost, want)
	}
}
