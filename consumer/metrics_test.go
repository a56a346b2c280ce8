package consumer

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Consumers of one durable on one registry (a consumer restarted in the same process) share
// their collectors, so the counts go on; another durable gets its own series.
func TestMetricsSharedByDurable(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	first, err := newMetrics(reg, testDurable)
	if err != nil {
		t.Fatal(err)
	}
	first.processed.Add(2)
	first.latency.Observe(0.01)
	again, err := newMetrics(reg, testDurable)
	if err != nil {
		t.Fatalf("a second consumer of the durable on the registry: %v", err)
	}
	again.processed.Inc()
	again.latency.Observe(time.Millisecond.Seconds())
	other, err := newMetrics(reg, "other")
	if err != nil {
		t.Fatal(err)
	}
	other.processed.Inc()
	if got := gather(t, reg, "txoutbox_consumer_processed_total"); got != 3 {
		t.Errorf("processed_total: %g, want 3 (both instances of %s)", got, testDurable)
	}
	if got := gather(t, reg, "txoutbox_consumer_handler_seconds"); got != 2 {
		t.Errorf("handler_seconds count: %g, want 2", got)
	}
}
