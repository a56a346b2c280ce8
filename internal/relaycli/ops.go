package relaycli

import (
	"context"
	"log/slog"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/internal/ops"
	"github.com/txoutbox/txoutbox/internal/status"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/relay"
)

// serveOps starts the operations listener: /metrics, /healthz, /readyz (PostgreSQL and NATS
// answer, and the relay is healthy or a standby) and the status page.
func serveOps(addr string, reg *prometheus.Registry, c *conns, r *relay.Relay, schema string, log *slog.Logger) (*ops.Server, error) {
	q := store.New(schema)
	return ops.Start(&ops.Config{
		Addr:     addr,
		Gatherer: reg,
		Logger:   log,
		Ready: func(ctx context.Context) []string {
			var problems []string
			if err := c.Pool.Ping(ctx); err != nil {
				problems = append(problems, "postgres: "+err.Error())
			}
			if st := c.NC.Status(); st != nats.CONNECTED {
				problems = append(problems, "nats: "+st.String())
			}
			if h := r.Health(); h != "ok" && h != "standby" {
				problems = append(problems, "relay: "+h)
			}
			if r.Lease().Mismatch {
				problems = append(problems, "relay: live relays disagree on the partition count")
			}
			return problems
		},
		Snapshot: func(ctx context.Context) (*status.Snapshot, error) {
			return status.Collect(ctx, c.Pool, q, &status.Options{Partitions: r.Config().Partitions})
		},
		Self: func() ops.Self {
			l := r.Lease()
			return ops.Self{Name: r.Config().ID, Health: r.Health(), Held: l.Held, Target: l.Target, Relays: l.Relays,
				Published: r.Stats().Published.Load()}
		},
	})
}
