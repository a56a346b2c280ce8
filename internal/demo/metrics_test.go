package demo

import (
	"bytes"
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// A small demo with -metrics-addr and -linger: after the summary, /metrics serves the
// families of every component (relay, check-back, consumer, the producers' outbox client, Go
// and process), with the counts the run made; Ctrl-C (the context) ends the linger.
//
// Not parallel: the consumer's crash point is process-wide, and a demo running beside this
// one (TestDemo) would crash its consumer.
func TestDemoServesMetrics(t *testing.T) {
	cfg := DefaultConfig()
	cfg.DSN = testsvc.PostgresDSN(t)
	cfg.Orders, cfg.Payments, cfg.Rate, cfg.Poison = 40, 12, 200, 1
	cfg.PaymentDie, cfg.Decline = 0.5, 0.1 // at least one dead producer: the check-back checks
	cfg.Timeout = 2 * time.Minute
	cfg.MetricsAddr, cfg.Linger = "127.0.0.1:0", time.Minute
	out := &testsvc.LogBuffer{} // the demo's output, written while the test reads it
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	type result struct {
		res *Result
		err error
	}
	done := make(chan result, 1)
	go func() { res, err := Run(ctx, cfg, out); done <- result{res, err} }()

	lingering := regexp.MustCompile(`Serving the run's metrics for 1m0s \(Ctrl-C to stop\): curl -s http://(127\.0\.0\.1:\d+)/metrics`)
	var addr string
	testsvc.Eventually(t, cfg.Timeout, "the demo to finish and linger", func() bool {
		select {
		case r := <-done:
			t.Fatalf("the demo returned before lingering: %v\n%s", r.err, out.String())
		default:
		}
		if m := lingering.FindStringSubmatch(out.String()); m != nil {
			addr = m[1]
		}
		return addr != ""
	})
	if !strings.Contains(out.String(), "Metrics:  http://"+addr+"/metrics") {
		t.Errorf("the output does not say where the metrics are served:\n%s", out.String())
	}
	if body, code := testsvc.HTTPGet(t, "http://"+addr+"/readyz"); code != 200 {
		t.Errorf("/readyz: %d %q", code, body)
	}
	families := []string{
		// relay
		"txoutbox_relay_published_total", "txoutbox_relay_duplicates_total", "txoutbox_relay_dead_total",
		"txoutbox_relay_batch_size_bucket", "txoutbox_relay_commit_to_publish_seconds_bucket", "txoutbox_relay_partitions_held",
		"txoutbox_relay_claim_seconds_bucket", "txoutbox_relay_settle_seconds_bucket",
		"txoutbox_postgres_oldest_xact_age_seconds", "txoutbox_postgres_xmin_horizon_age_xids",
		"txoutbox_outbox_messages", // (the per-partition backlog is there only while the relay holds
		// partitions; by now it may have let them go: the relay and relaycli tests check it)
		// check-back
		"txoutbox_checkback_checks_total", "txoutbox_checkback_resolved_total", "txoutbox_checkback_job_duration_seconds_bucket",
		// consumer
		"txoutbox_consumer_processed_total", "txoutbox_consumer_duplicates_total", "txoutbox_consumer_retries_total",
		"txoutbox_consumer_dead_lettered_total", "txoutbox_consumer_handler_seconds_bucket",
		// producers' outbox client
		"txoutbox_outbox_half_prepared_total", "txoutbox_outbox_half_committed_total", "txoutbox_outbox_half_rolled_back_total",
		// Go and process
		"go_goroutines", "process_resident_memory_bytes",
	}
	// The sampled gauges appear with the relay's first sample: wait for every family rather
	// than read /metrics once.
	var metrics string
	missing := func() []string {
		var out []string
		for _, family := range families {
			if !strings.Contains(metrics, "\n"+family) {
				out = append(out, family)
			}
		}
		return out
	}
	testsvc.Eventually(t, 30*time.Second, "every metric family on /metrics", func() bool {
		var code int
		metrics, code = testsvc.HTTPGet(t, "http://"+addr+"/metrics")
		return code == 200 && len(missing()) == 0
	})
	for _, family := range missing() {
		t.Errorf("/metrics lacks %s", family)
	}
	for _, name := range []string{"txoutbox_relay_published_total", "txoutbox_relay_partition_changes_total", "txoutbox_checkback_checks_total",
		"txoutbox_checkback_resolved_total", "txoutbox_consumer_processed_total", "txoutbox_consumer_retries_total",
		"txoutbox_consumer_dead_lettered_total"} {
		if v := sum(metrics, name); v <= 0 {
			t.Errorf("%s = %g, want some after the run", name, v)
		}
	}
	if v := sum(metrics, "txoutbox_outbox_half_prepared_total"); v != float64(cfg.Payments) {
		t.Errorf("txoutbox_outbox_half_prepared_total = %g, want %d (one per payment)", v, cfg.Payments)
	}

	stop() // Ctrl-C
	var r result
	select {
	case r = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the linger did not end with the context")
	}
	if r.err != nil || !r.res.OK() {
		t.Fatalf("demo: %v\n%s", r.err, out.String())
	}
	// The consumer's counters go on over its restarts: the metric is every instance's sum.
	if v := sum(metrics, "txoutbox_consumer_processed_total"); v != float64(r.res.ConsumerProcessed) {
		t.Errorf("txoutbox_consumer_processed_total = %g, the consumers' stats say %d (%d crashes)", v, r.res.ConsumerProcessed, r.res.ConsumerCrashes)
	}
	// How many payments their producers committed is up to chance (it may be none): the
	// counter must say what the outbox table says.
	if v := sum(metrics, "txoutbox_outbox_half_committed_total"); v != float64(r.res.HalfCommittedByProducer) {
		t.Errorf("txoutbox_outbox_half_committed_total = %g, the outbox says %d committed by their producer", v, r.res.HalfCommittedByProducer)
	}
	if v := sum(metrics, "txoutbox_relay_duplicates_total"); v != float64(r.res.RelayDuplicates) {
		t.Errorf("txoutbox_relay_duplicates_total = %g, the relay's stats say %d", v, r.res.RelayDuplicates)
	}
}

// The demo's flags: -linger needs -metrics-addr, which must be host:port; neither is for -chaos.
func TestMainMetricsFlags(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"-linger", "1m"}, {"-metrics-addr", "9090"}, {"-metrics-addr", "127.0.0.1:0", "-linger", "-1s"}, {"-chaos", "-metrics-addr", "127.0.0.1:0"}} {
		var out, errOut bytes.Buffer
		if code := Main(args, &out, &errOut); code != 2 || !strings.Contains(errOut.String(), "-") {
			t.Errorf("%q: exit %d, want 2 (%s)", args, code, errOut.String())
		}
	}
}

// sum adds up the samples of name (every label set) in a text exposition.
func sum(exposition, name string) float64 {
	var total float64
	for _, line := range strings.Split(exposition, "\n") {
		rest, ok := strings.CutPrefix(line, name)
		if !ok || (!strings.HasPrefix(rest, " ") && !strings.HasPrefix(rest, "{")) {
			continue
		}
		fields := strings.Fields(rest[strings.LastIndex(rest, "}")+1:])
		if len(fields) == 0 {
			continue
		}
		if v, err := strconv.ParseFloat(fields[0], 64); err == nil {
			total += v
		}
	}
	return total
}
