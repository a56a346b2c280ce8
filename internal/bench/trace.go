package bench

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// The tracing cost (drain --trace): the same backlog drained again, in the same run, by a
// relay with tracing on — every span sampled (AlwaysSample), batched by the SDK's batch span
// processor as in production, and handed to an exporter that counts and discards them — from
// messages that each carry a producer's traceparent (captured at enqueue). The relay then
// starts, fills and ends one publish span per message.

// countingExporter counts the spans exported to it and discards them.
type countingExporter struct{ spans atomic.Int64 }

func (e *countingExporter) ExportSpans(_ context.Context, spans []sdktrace.ReadOnlySpan) error {
	e.spans.Add(int64(len(spans)))
	return nil
}

func (e *countingExporter) Shutdown(context.Context) error { return nil }

// tracedDrain is what drainTraced measured.
type tracedDrain struct {
	dur      time.Duration
	exported int64 // publish spans exported (the batch span processor drops spans when its queue is full)
	check    checkResult
}

// drainTraced enqueues set again, each transaction under a sampled span of its own, into a
// fresh schema and stream, and times a relay with tracing on until the stream holds it all.
func drainTraced(ctx context.Context, r *run, set *msgSet, o *drainOpts) (*tracedDrain, error) {
	const stream, subject, subjects = streamPrefix + "DRAINTRACE", "bench.traced.msg", "bench.traced.>"
	schema, err := r.NewSchema(ctx)
	if err != nil {
		return nil, err
	}
	s, err := r.ResetStream(ctx, stream, subjects)
	if err != nil {
		return nil, err
	}
	exp := &countingExporter{}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithBatcher(exp))
	defer func() { _ = tp.Shutdown(context.WithoutCancel(ctx)) }()
	prop := propagation.TraceContext{}

	pool, err := r.NewPool(ctx, int32(o.loaders+1))
	if err != nil {
		return nil, err
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: schema, TracerProvider: tp, Propagator: prop, EnqueueSpan: true})
	if err != nil {
		return nil, err
	}
	r.logf("traced: enqueueing the same %d messages, each transaction under a sampled span (relay stopped)", len(set.ids))
	if _, err := enqueueBacklog(ctx, r, pool, client, schema, set, subject, o); err != nil {
		return nil, err
	}
	rank, err := outboxOrder(ctx, pool, schema, set)
	if err != nil {
		return nil, err
	}
	if err := tp.ForceFlush(ctx); err != nil {
		return nil, err
	}
	enqueueSpans := exp.spans.Load()

	rpool, err := r.NewPool(ctx, 4)
	if err != nil {
		return nil, err
	}
	nc, err := r.ConnectRelayNATS("outbox-bench traced relay")
	if err != nil {
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	rl, err := relay.New(rpool, js, &relay.Config{Schema: schema, Subjects: []string{subjects}, Logger: relayLogger(r.env.Stderr),
		TracerProvider: tp, Propagator: prop})
	if err != nil {
		return nil, err
	}
	rctx, stopRelay := context.WithCancel(ctx)
	defer stopRelay()
	runErr := make(chan error, 1)
	r.logf("traced relay: starting (tracing on: always sample, batch span processor, discarding exporter)")
	t0 := time.Now()
	go func() { runErr <- rl.Run(rctx) }()
	dur, err := waitForStream(ctx, r, s, uint64(len(set.ids)), t0, o.timeout, runErr)
	if err != nil {
		return nil, err
	}
	if err := waitForOutboxEmpty(ctx, pool, schema, 30*time.Second); err != nil {
		return nil, err
	}
	stopRelay()
	if err := <-runErr; err != nil {
		return nil, fmt.Errorf("traced relay: %w", err)
	}
	if err := tp.ForceFlush(ctx); err != nil {
		return nil, err
	}
	res, err := checkStream(ctx, r.JS, stream, set, rank)
	if err != nil {
		return nil, err
	}
	out := &tracedDrain{dur: dur, exported: exp.spans.Load() - enqueueSpans, check: res}
	r.logf("traced relay: %d messages stored in %s (%.0f msgs/s); %d publish spans exported; check: %s",
		len(set.ids), dur.Round(time.Millisecond), float64(len(set.ids))/dur.Seconds(), out.exported, res)
	if !r.keep {
		r.DeleteStream(stream)
	}
	return out, nil
}

// traceResult are the final line's fields of drain --trace (none without it): the traced
// relay's rate, its ratio to the ceiling, and the cost of tracing, 1 - traced/untraced rate.
func traceResult(t *tracedDrain, msgs int, relayRate, ceilRate float64) []any {
	if t == nil {
		return nil
	}
	rate := float64(msgs) / t.dur.Seconds()
	kv := []any{"traced_relay_msgs_per_s", rate}
	if ceilRate > 0 {
		kv = append(kv, "traced_ratio", rate/ceilRate)
	}
	return append(kv, "trace_cost", 1-rate/relayRate,
		"publish_spans", t.exported, "traced_lost", t.check.Lost, "traced_duplicates", t.check.Duplicates)
}
