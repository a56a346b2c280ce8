package relaycli

import (
	"context"
	"log/slog"
	"net"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/txoutbox/txoutbox/internal/ops"
	"github.com/txoutbox/txoutbox/internal/status"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/relay"
)

// defineMetricsAddr adds --metrics-addr, the first setting of an "Operations" section.
func defineMetricsAddr(s *settings, p *string) {
	sec := s.Section("Operations")
	s.String(p, "metrics-addr", "", "", "serve /metrics, /healthz, /readyz and the status page (/) on this address (e.g. 127.0.0.1:9090); off when empty")
	sec("metrics-addr")
}

// checkMetricsAddr validates --metrics-addr (empty is off).
func checkMetricsAddr(addr string) error {
	if addr == "" {
		return nil
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return usageErr("invalid --metrics-addr %q: %v", addr, err)
	}
	return nil
}

// newRegistry is the process's one registry, with the Go and process collectors: the
// components a command runs register their collectors here, and /metrics serves them all.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// startOps starts the operations listener of cfg and logs its address.
func startOps(cfg *ops.Config, log *slog.Logger) (*ops.Server, error) {
	srv, err := ops.Start(cfg)
	if err != nil {
		return nil, err
	}
	log.Info("serving metrics, health and the status page", "addr", srv.Addr())
	return srv, nil
}

// connProblems reports what keeps c's PostgreSQL and NATS from answering (none when ready).
func connProblems(ctx context.Context, c *conns) []string {
	var problems []string
	if err := c.Pool.Ping(ctx); err != nil {
		problems = append(problems, "postgres: "+err.Error())
	}
	if st := c.NC.Status(); st != nats.CONNECTED {
		problems = append(problems, "nats: "+st.String())
	}
	return problems
}

// snapshotter returns the status page's snapshot of schema; partitions is the count to group
// the backlog by when no relay is alive (0: the default).
func snapshotter(c *conns, schema string, partitions int) func(ctx context.Context) (*status.Snapshot, error) {
	q := store.New(schema)
	return func(ctx context.Context) (*status.Snapshot, error) {
		return status.Collect(ctx, c.Pool, q, &status.Options{Partitions: partitions})
	}
}

// serveOps starts the relay's operations listener: /metrics, /healthz, /readyz (PostgreSQL
// and NATS answer, and the relay is healthy or a standby) and the status page.
func serveOps(addr string, reg *prometheus.Registry, c *conns, r *relay.Relay, schema string, log *slog.Logger) (*ops.Server, error) {
	return startOps(&ops.Config{
		Addr:     addr,
		Gatherer: reg,
		Logger:   log,
		Ready: func(ctx context.Context) []string {
			problems := connProblems(ctx, c)
			if h := r.Health(); h != "ok" && h != "standby" {
				problems = append(problems, "relay: "+h)
			}
			if r.Lease().Mismatch {
				problems = append(problems, "relay: live relays disagree on the partition count")
			}
			return problems
		},
		Snapshot: snapshotter(c, schema, r.Config().Partitions),
		Self: func() ops.Self {
			l := r.Lease()
			return ops.Self{Name: r.Config().ID, Health: r.Health(), Held: l.Held, Target: l.Target, Relays: l.Relays,
				Published: r.Stats().Published.Load()}
		},
	}, log)
}

// serveCheckbackOps starts the operations listener of `relay checkback`: /metrics, /healthz,
// /readyz (PostgreSQL and NATS answer) and the status page.
func serveCheckbackOps(addr string, reg *prometheus.Registry, c *conns, schema string, log *slog.Logger) (*ops.Server, error) {
	return startOps(&ops.Config{
		Addr:     addr,
		Gatherer: reg,
		Logger:   log,
		Ready:    func(ctx context.Context) []string { return connProblems(ctx, c) },
		Snapshot: snapshotter(c, schema, 0),
	}, log)
}
