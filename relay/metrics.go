package relay

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the relay's Prometheus collectors. They always count; they are exported only
// when Config.Registerer is set.
type metrics struct {
	published  prometheus.Counter
	duplicates prometheus.Counter
	failures   *prometheus.CounterVec
	dead       prometheus.Counter
	batchSize  prometheus.Histogram
	latency    prometheus.Histogram
	partitions prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		published: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "published_total",
			Help: "Outbox rows published to JetStream and settled.",
		}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "duplicates_total",
			Help: "PubAcks that reported a duplicate (a republish absorbed by the stream's duplicate window).",
		}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "publish_failures_total",
			Help: "Failed publishes by kind: message (counts an attempt) or broker (outage, no attempt counted).",
		}, []string{"kind"}),
		dead: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "dead_total",
			Help: "Rows that became dead after MaxAttempts failed publishes.",
		}),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "batch_size",
			Help:    "Rows per claimed batch.",
			Buckets: []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000},
		}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "commit_to_publish_seconds",
			Help:    "Time from a row becoming ready (its insert, or a half message's commit) to its PubAck.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18),
		}),
		partitions: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "partitions_held",
			Help: "Partitions this relay holds the lease of.",
		}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.published, m.duplicates, m.failures, m.dead, m.batchSize, m.latency, m.partitions} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("relay: register metrics: %w", err)
		}
	}
	return m, nil
}
