package relaycli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"

	"github.com/google/uuid"
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

// checkMetricsAddr validates --metrics-addr (empty is off): host:port, the port a number from
// 0 to 65535 (0: any free port). Only SplitHostPort was checked, so a port out of range (or
// not a number) failed at listen time, with exit status 1, instead of as a setting.
func checkMetricsAddr(addr string) error {
	if addr == "" {
		return nil
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return usageErr("invalid --metrics-addr %q: %v", addr, err)
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return usageErr("invalid --metrics-addr %q: port %q: want a number from 0 to 65535", addr, port)
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
		// A port in use, say: name the setting.
		return nil, fmt.Errorf("--metrics-addr (%s): %w", envName("metrics-addr"), err)
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

// opsTarget is what the operations listener serves. A command starts the listener before it
// connects, so that /healthz answers from the start and /readyz says what it waits for; it
// attaches the real checks once connected.
type opsTarget struct {
	name    string
	waiting *waitState

	mu       sync.Mutex
	ready    func(ctx context.Context) []string
	snapshot func(ctx context.Context) (*status.Snapshot, error)
	self     func() ops.Self
	message  func(ctx context.Context, id uuid.UUID) (*store.MessageDetail, error)
}

// notYet is why the command is not ready before its checks are attached.
func (t *opsTarget) notYet() string {
	if why := t.waiting.get(); why != "" {
		return why
	}
	return "starting"
}

func (t *opsTarget) attached() (func(context.Context) []string, func(context.Context) (*status.Snapshot, error), func() ops.Self) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ready, t.snapshot, t.self
}

func (t *opsTarget) attach(ready func(context.Context) []string, snapshot func(context.Context) (*status.Snapshot, error), self func() ops.Self) {
	t.mu.Lock()
	t.ready, t.snapshot, t.self = ready, snapshot, self
	t.mu.Unlock()
}

// attachMessages makes /messages/{id} (the page the status page links dead rows to) read the
// rows of schema.
func (t *opsTarget) attachMessages(c *conns, schema string) {
	q := store.New(schema)
	t.mu.Lock()
	t.message = func(ctx context.Context, id uuid.UUID) (*store.MessageDetail, error) {
		return q.Message(ctx, c.Pool, id)
	}
	t.mu.Unlock()
}

// startOpsEarly starts the operations listener of a command (on the outbox in schema) that has not connected yet:
// /metrics serves reg, /healthz answers 200, /readyz 503 with what the command waits for (from
// waiting) until attach. name, when set, is the process's name on the status page (which then
// shows the process itself, as a relay's does).
func startOpsEarly(addr string, reg *prometheus.Registry, name, schema string, waiting *waitState, log *slog.Logger) (*ops.Server, *opsTarget, error) {
	t := &opsTarget{name: name, waiting: waiting}
	cfg := &ops.Config{
		Addr:     addr,
		Schema:   schema,
		Gatherer: reg,
		Logger:   log,
		Ready: func(ctx context.Context) []string {
			if ready, _, _ := t.attached(); ready != nil {
				return ready(ctx)
			}
			return []string{t.notYet()}
		},
		Snapshot: func(ctx context.Context) (*status.Snapshot, error) {
			if _, snap, _ := t.attached(); snap != nil {
				return snap(ctx)
			}
			return nil, errors.New(t.notYet())
		},
		Message: func(ctx context.Context, id uuid.UUID) (*store.MessageDetail, error) {
			t.mu.Lock()
			m := t.message
			t.mu.Unlock()
			if m == nil {
				return nil, errors.New(t.notYet())
			}
			return m(ctx, id)
		},
	}
	if name != "" {
		cfg.Self = func() ops.Self {
			if _, _, self := t.attached(); self != nil {
				return self()
			}
			return ops.Self{Name: t.name, Health: t.notYet()}
		}
	}
	srv, err := startOps(cfg, log)
	if err != nil {
		return nil, nil, err
	}
	return srv, t, nil
}

// attachRelay makes t serve the relay's checks: /readyz is ready when PostgreSQL and NATS
// answer and the relay is healthy or a standby; the status page shows it.
func (t *opsTarget) attachRelay(c *conns, r *relay.Relay, schema string) {
	t.attachMessages(c, schema)
	t.attach(func(ctx context.Context) []string {
		problems := connProblems(ctx, c)
		if h := r.Health(); h != relay.HealthOK && h != relay.HealthStandby {
			problems = append(problems, "relay: "+string(h))
		}
		if r.Lease().Mismatch {
			problems = append(problems, "relay: live relays disagree on the partition count")
		}
		return problems
	}, snapshotter(c, schema, r.Config().Partitions), func() ops.Self {
		l := r.Lease()
		return ops.Self{Name: r.Config().ID, Health: string(r.Health()), Held: l.Held, Target: l.Target, Relays: l.Relays,
			Published: r.Stats().Published}
	})
}

// attachCheckback makes t serve the checks of `relay checkback`: /readyz is ready when
// PostgreSQL and NATS answer.
func (t *opsTarget) attachCheckback(c *conns, schema string) {
	t.attachMessages(c, schema)
	t.attach(func(ctx context.Context) []string { return connProblems(ctx, c) }, snapshotter(c, schema, 0), nil)
}
