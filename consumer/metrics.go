package consumer

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Stats are a consumer's running totals, always counted (with or without Prometheus), for
// other code to read or export.
type Stats struct {
	// Processed counts messages whose handler ran and whose transaction committed.
	Processed atomic.Int64
	// Duplicates counts messages skipped because their idempotency key was already recorded.
	Duplicates atomic.Int64
	// Retries counts handler failures that scheduled another attempt.
	Retries atomic.Int64
	// DeadLettered counts messages published to the dead-letter subject and terminated.
	DeadLettered atomic.Int64
	// Malformed counts the dead-lettered messages that could not be decoded.
	Malformed atomic.Int64
	// Unavailable counts messages put back because Postgres or NATS failed (begin, dedup
	// insert, commit, a broken connection, a dead-letter publish); these never count as an
	// attempt and are never acked.
	Unavailable atomic.Int64
	// AckFailures counts acks that got no server confirmation after a commit; the message
	// comes back and is skipped as a duplicate.
	AckFailures atomic.Int64
	// HandlerCalls and HandlerNanos sum the handler's runs and their duration; in batch mode
	// they include the reruns (see Config.BatchSize).
	HandlerCalls atomic.Int64
	HandlerNanos atomic.Int64
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
	if reg == nil {
		return m, nil
	}
	for _, p := range []*prometheus.Counter{&m.processed, &m.duplicates, &m.retries, &m.deadLettered, &m.unavailable} {
		if err := register(reg, p); err != nil {
			return nil, err
		}
	}
	if err := register(reg, &m.latency); err != nil {
		return nil, err
	}
	return m, nil
}

// register registers *c with reg. Consumers of one durable on one registry (several in a
// process, or one restarted after a failure) share the collectors: *c becomes the one
// registered first.
func register[C prometheus.Collector](reg prometheus.Registerer, c *C) error {
	err := reg.Register(*c)
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			*c = existing
			return nil
		}
	}
	if err != nil {
		return fmt.Errorf("consumer: register metrics: %w", err)
	}
	return nil
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
