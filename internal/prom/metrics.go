// Package prom registers the components' Prometheus collectors, one way for all of them.
package prom

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Collector is one collector field of a component's metrics, made with Of.
type Collector interface {
	register(reg prometheus.Registerer) error
}

type field[C prometheus.Collector] struct{ p *C }

// Of wraps a pointer to a collector field for Register.
func Of[C prometheus.Collector](p *C) Collector { return field[C]{p} }

func (f field[C]) register(reg prometheus.Registerer) error {
	err := reg.Register(*f.p)
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			*f.p = existing // the same collector registered by a twin: share it
			return nil
		}
	}
	return err
}

// Register registers every collector with reg (nothing when reg is nil). A collector that an
// identical one already holds on reg — from another component of the same kind on the same
// registry: two relays, two clients, a consumer restarted — is adopted: the field is set to
// the registered collector, so the components share it, counters add up and a gauge shows the
// last value set. To tell such components apart, give each its own registerer, e.g.
// prometheus.WrapRegistererWith(prometheus.Labels{"relay": id}, reg).
func Register(reg prometheus.Registerer, component string, cs ...Collector) error {
	if reg == nil {
		return nil
	}
	for _, c := range cs {
		if err := c.register(reg); err != nil {
			return fmt.Errorf("%s: register metrics: %w", component, err)
		}
	}
	return nil
}
