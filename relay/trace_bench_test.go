package relay

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/tracing"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// discard counts exported spans and drops them.
type discard struct{ n atomic.Int64 }

func (d *discard) ExportSpans(_ context.Context, s []sdktrace.ReadOnlySpan) error {
	d.n.Add(int64(len(s)))
	return nil
}
func (d *discard) Shutdown(context.Context) error { return nil }

// benchRows is a batch of claimed rows as the relay builds them, each with a producer's
// traceparent in its headers.
func benchRows(n int) ([]store.Claimed, []*nats.Msg) {
	rows := make([]store.Claimed, n)
	msgs := make([]*nats.Msg, n)
	tp := sdktrace.NewTracerProvider()
	for i := range rows {
		ctx, span := tp.Tracer("producer").Start(context.Background(), "request")
		span.End()
		h := nats.Header{}
		propagation.TraceContext{}.Inject(ctx, tracing.Carrier(h))
		rows[i] = store.Claimed{ID: int64(i), MessageID: uuid.New(), Subject: "orders.created", Payload: make([]byte, 512), ReadyAt: time.Now()}
		h.Set("Nats-Msg-Id", rows[i].MessageID.String())
		msgs[i] = &nats.Msg{Subject: "orders.created", Header: h, Data: rows[i].Payload}
	}
	return rows, msgs
}

// BenchmarkPublishSpans is the relay's tracing cost per message, in CPU time (cpu-ns/op: the
// process's, so the batch span processor's export goroutine is counted too; wall-clock ns/op
// depends on the machine's load): the publish
// span's start (the producer's context extracted from the headers) and end (with the
// PubAck's attributes), with tracing off (the global no-op provider and propagator), and on
// (every span sampled, the SDK's batch span processor, a discarding exporter), beside the
// alternative of one span per batch of 500 with a link per message.
//
//	go test ./relay -run '^$' -bench PublishSpans -benchtime 200000x
func BenchmarkPublishSpans(b *testing.B) {
	rows, msgs := benchRows(500)
	ack := &jetstream.PubAck{Stream: "ORDERS", Sequence: 42}
	on := func(b *testing.B) (*relayTracer, *discard) {
		d := &discard{}
		tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithBatcher(d))
		b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
		return newRelayTracer(&Config{TracerProvider: tp, Propagator: propagation.TraceContext{}}), d
	}
	b.Run("off", func(b *testing.B) {
		rt := newRelayTracer(&Config{})
		b.ReportAllocs()
		cpu := cpuTime()
		for i := 0; b.Loop(); i++ {
			j := i % len(rows)
			endPublish(rt.startPublish(context.Background(), &rows[j], msgs[j]), outcome{ack: ack})
		}
		b.ReportMetric(float64(cpuTime()-cpu)/float64(b.N), "cpu-ns/op")
	})
	b.Run("per-message", func(b *testing.B) {
		rt, d := on(b)
		b.ReportAllocs()
		cpu := cpuTime()
		for i := 0; b.Loop(); i++ {
			j := i % len(rows)
			endPublish(rt.startPublish(context.Background(), &rows[j], msgs[j]), outcome{ack: ack})
		}
		b.ReportMetric(float64(cpuTime()-cpu)/float64(b.N), "cpu-ns/op")
		b.ReportMetric(float64(d.n.Load())/float64(b.N), "exported/op")
	})
	b.Run("per-message-parent-not-sampled", func(b *testing.B) {
		// The SDK's default sampler (parent-based) with producers sampling none of these
		// messages: what the relay pays for the messages a sampling producer left out.
		d := &discard{}
		tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(d))
		b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
		rt := newRelayTracer(&Config{TracerProvider: tp, Propagator: propagation.TraceContext{}})
		unsampled := make([]*nats.Msg, len(msgs))
		for j, m := range msgs {
			h := nats.Header{}
			for k, v := range m.Header {
				h[k] = v
			}
			tp := h.Get("traceparent")
			h.Set("traceparent", tp[:len(tp)-2]+"00")
			unsampled[j] = &nats.Msg{Subject: m.Subject, Header: h, Data: m.Data}
		}
		b.ReportAllocs()
		cpu := cpuTime()
		for i := 0; b.Loop(); i++ {
			j := i % len(rows)
			endPublish(rt.startPublish(context.Background(), &rows[j], unsampled[j]), outcome{ack: ack})
		}
		b.ReportMetric(float64(cpuTime()-cpu)/float64(b.N), "cpu-ns/op")
		b.ReportMetric(float64(d.n.Load())/float64(b.N), "exported/op")
	})
	b.Run("per-batch-with-links", func(b *testing.B) {
		rt, _ := on(b)
		b.ReportAllocs()
		links := make([]trace.Link, 0, len(rows))
		cpu := cpuTime()
		for i := 0; b.Loop(); i++ {
			j := i % len(rows)
			links = append(links, trace.Link{SpanContext: tracing.Extract(rt.p, msgs[j].Header)})
			if len(links) == len(rows) {
				_, span := rt.t.Start(context.Background(), "publish", trace.WithLinks(links...))
				span.End()
				links = links[:0]
			}
		}
		b.ReportMetric(float64(cpuTime()-cpu)/float64(b.N), "cpu-ns/op")
	})
}
