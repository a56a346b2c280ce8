package prom

import (
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

type set struct {
	c prometheus.Counter
	v *prometheus.CounterVec
}

func newSet() *set {
	return &set{
		c: prometheus.NewCounter(prometheus.CounterOpts{Name: "x_total", Help: "x"}),
		v: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "y_total", Help: "y"}, []string{"k"}),
	}
}

func TestTwinsShareTheirCollectors(t *testing.T) {
	reg := prometheus.NewRegistry()
	a, b := newSet(), newSet()
	for _, s := range []*set{a, b} {
		if err := Register(reg, "test", Of(&s.c), Of(&s.v)); err != nil {
			t.Fatalf("Register: %v", err)
		}
	}
	a.c.Inc()
	b.c.Inc()
	b.v.WithLabelValues("k").Inc()
	if got := testutil.ToFloat64(a.c); got != 2 {
		t.Fatalf("shared counter = %v, want 2", got)
	}
	if got := testutil.ToFloat64(a.v.WithLabelValues("k")); got != 1 {
		t.Fatalf("shared vec = %v, want 1", got)
	}
}

func TestAConflictingCollectorIsAnError(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: "x_total", Help: "another help"}))
	s := newSet()
	err := Register(reg, "test", Of(&s.c))
	if err == nil {
		t.Fatal("a conflicting collector was accepted")
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		t.Fatalf("got AlreadyRegisteredError, want the descriptor conflict: %v", err)
	}
	if err := Register(nil, "test", Of(&s.c)); err != nil {
		t.Fatalf("nil registerer: %v", err)
	}
}
