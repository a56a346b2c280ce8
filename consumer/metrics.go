package consumer

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/internal/prom"
)

// Stats are a consumer's running totals, always counted (with or without Prometheus), for
// other code to read or export.
type Stats struct {
	// Processed counts messages whose handler ran and whose transaction committed.
	Processed int64
	// Duplicates counts messages skipped because their idempotency key was already recorded.
	Duplicates int64
	// Retries counts handler failures that scheduled another attempt.
	Retries int64
	// DeadLettered counts messages published to the dead-letter subject and terminated.
	DeadLettered int64
	// Malformed counts the dead-lettered messages that could not be decoded.
	Malformed int64
	// Unavailable counts messages put back because Postgres or NATS failed (begin, dedup
	// insert, commit, a broken connection, a dead-letter publish); these never count as an
	// attempt and are never acked. The handlers the stop timeout cancels are not counted.
	Unavailable int64
	// AckFailures counts acks that got no server confirmation after a commit; the message
	// comes back and is skipped as a duplicate.
	AckFailures int64
	// HandlerCalls and HandlerTime sum the handler's runs and the time they took; in batch
	// mode they include the reruns (see Config.BatchSize and NewBatch). With NewBatch, a call
	// is one run of the BatchHandler, however many messages it got.
	HandlerCalls int64
	HandlerTime  time.Duration
}

// counters are the running totals behind Stats.
type counters struct {
	Processed    atomic.Int64
	Duplicates   atomic.Int64
	Retries      atomic.Int64
	DeadLettered atomic.Int64
	Malformed    atomic.Int64
	Unavailable  atomic.Int64
	AckFailures  atomic.Int64
	HandlerCalls atomic.Int64
	HandlerNanos atomic.Int64 // nanoseconds, as Stats.HandlerTime
}

func (c *counters) snapshot() Stats {
	return Stats{
		Processed:    c.Processed.Load(),
		Duplicates:   c.Duplicates.Load(),
		Retries:      c.Retries.Load(),
		DeadLettered: c.DeadLettered.Load(),
		Malformed:    c.Malformed.Load(),
		Unavailable:  c.Unavailable.Load(),
		AckFailures:  c.AckFailures.Load(),
		HandlerCalls: c.HandlerCalls.Load(),
		HandlerTime:  time.Duration(c.HandlerNanos.Load()),
	}
}

// metrics are the consumer's Prometheus collectors, registered only when Config.Registerer
// is set.
type metrics struct {
	processed    prometheus.Counter
	duplicates   prometheus.Counter
	retries      prometheus.Counter
	deadLettered prometheus.Counter
	unavailable  prometheus.Counter
	latency      prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer, durable string) (*metrics, error) {
	labels := prometheus.Labels{"consumer": durable}
	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "txoutbox", Subsystem: "consumer", Name: name, Help: help, ConstLabels: labels,
		})
	}
	m := &metrics{
		processed:    counter("processed_total", "Messages handled and committed."),
		duplicates:   counter("duplicates_total", "Messages skipped because their idempotency key was already processed."),
		retries:      counter("retries_total", "Handler failures that scheduled another attempt."),
		deadLettered: counter("dead_lettered_total", "Messages sent to the dead-letter subject (failed too often, rejected as permanent, or malformed)."),
		unavailable:  counter("unavailable_total", "Messages put back, without counting an attempt, because Postgres or NATS failed."),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "txoutbox", Subsystem: "consumer", Name: "handler_seconds",
			Help:        "Handler run time (inside the consumer's transaction).",
			ConstLabels: labels,
			Buckets:     prometheus.ExponentialBuckets(0.0001, 2, 20),
		}),
	}
	// Consumers of one durable on one registry (several in a process, or one restarted after
	// a failure) share the collectors.
	if err := prom.Register(reg, "consumer", prom.Of(&m.processed), prom.Of(&m.duplicates), prom.Of(&m.retries),
		prom.Of(&m.deadLettered), prom.Of(&m.unavailable), prom.Of(&m.latency)); err != nil {
		return nil, err
	}
	return m, nil
}

func (c *Consumer) countProcessed(n int) {
	c.stats.Processed.Add(int64(n))
	c.m.processed.Add(float64(n))
}

func (c *Consumer) countDuplicate() {
	c.stats.Duplicates.Add(1)
	c.m.duplicates.Inc()
}

func (c *Consumer) countRetry() {
	c.stats.Retries.Add(1)
	c.m.retries.Inc()
}

func (c *Consumer) countDeadLettered(malformed bool) {
	c.stats.DeadLettered.Add(1)
	if malformed {
		c.stats.Malformed.Add(1)
	}
	c.m.deadLettered.Inc()
}

func (c *Consumer) countUnavailable(n int) {
	c.stats.Unavailable.Add(int64(n))
	c.m.unavailable.Add(float64(n))
}

func (c *Consumer) observeHandler(d time.Duration) {
	c.stats.HandlerCalls.Add(1)
	c.stats.HandlerNanos.Add(int64(d))
	c.m.latency.Observe(d.Seconds())
}
