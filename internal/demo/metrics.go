package demo

import (
	"context"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/internal/ops"
	"github.com/txoutbox/txoutbox/internal/status"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/relay"
)

// registerer is where the components register their metrics: the run's registry, or none.
func (r *run) registerer() prometheus.Registerer {
	if r.reg == nil {
		return nil // not a typed nil: the components then register nothing
	}
	return r.reg
}

// serveMetrics starts the operations listener on Config.MetricsAddr (when set) and says
// where: /metrics with every component's families, /healthz, /readyz (PostgreSQL, NATS and
// the relay) and the relay's status page. It runs until the run is closed, through the
// linger.
func (r *run) serveMetrics() error {
	if r.reg == nil {
		return nil
	}
	q := store.New(r.schema)
	srv, err := ops.Start(&ops.Config{
		Addr:     r.cfg.MetricsAddr,
		Gatherer: r.reg,
		Logger:   r.log,
		Ready: func(ctx context.Context) []string {
			var problems []string
			if err := r.pool.Ping(ctx); err != nil {
				problems = append(problems, "postgres: "+err.Error())
			}
			if st := r.nc.Status(); st != nats.CONNECTED {
				problems = append(problems, "nats: "+st.String())
			}
			if h := r.relay.Health(); h != relay.HealthOK && h != relay.HealthStandby {
				problems = append(problems, "relay: "+string(h))
			}
			return problems
		},
		Snapshot: func(ctx context.Context) (*status.Snapshot, error) {
			return status.Collect(ctx, r.pool, q, &status.Options{Partitions: r.relay.Config().Partitions})
		},
		Message: func(ctx context.Context, id uuid.UUID) (*store.MessageDetail, error) {
			return q.Message(ctx, r.pool, id)
		},
		Self: func() ops.Self {
			l := r.relay.Lease()
			return ops.Self{Name: r.relay.Config().ID, Health: string(r.relay.Health()), Held: l.Held, Target: l.Target, Relays: l.Relays,
				Published: r.relay.Stats().Published}
		},
	})
	if err != nil {
		return err
	}
	r.ops = srv
	r.say("Metrics:  http://%s/metrics (every component's families), /healthz, /readyz, and the relay's status page at /", srv.Addr())
	r.say("")
	return nil
}

// linger keeps the operations listener serving after the summary, for Config.Linger or
// until ctx ends.
func (r *run) linger(ctx context.Context) {
	if r.ops == nil || r.cfg.Linger <= 0 {
		return
	}
	r.say("")
	r.say("Serving the run's metrics for %s (Ctrl-C to stop): curl -s http://%s/metrics | grep ^txoutbox_", r.cfg.Linger, r.ops.Addr())
	t := time.NewTimer(r.cfg.Linger)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
