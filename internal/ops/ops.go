// Package ops is the relay's operations listener: /metrics (Prometheus), /healthz (the
// process is alive), /readyz (its dependencies answer), and a read-only status page at /
// (with the same data as JSON at /status.json).
//
// It knows nothing about the relay itself: the caller supplies the checks and the data as
// functions, so other daemons (a consumer, the check-back) can serve the same page.
package ops

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/txoutbox/txoutbox/internal/status"
	"github.com/txoutbox/txoutbox/internal/store"
)

// Defaults for Config.
const (
	DefaultCacheTTL         = 2 * time.Second
	DefaultThroughputSample = 5 * time.Second
	DefaultRefresh          = 5 * time.Second
)

// Self is what the serving process says about itself on the status page.
type Self struct {
	Name   string `json:"name"`   // e.g. the relay id
	Health string `json:"health"` // "ok", "standby", or a problem
	// Held are the partitions this process holds; Target its fair share; Relays the live
	// relays it sees.
	Held   []int32 `json:"held"`
	Target int     `json:"target"`
	Relays int     `json:"relays"`
	// Published is a running total (messages published by this process), for throughput.
	Published int64 `json:"published"`
}

// Config configures a Server.
type Config struct {
	// Addr is the listen address, e.g. 127.0.0.1:9090 (required).
	Addr string
	// Gatherer serves /metrics. Defaults to none (404).
	Gatherer prometheus.Gatherer
	// Ready returns what keeps the process from being ready (empty when ready). Defaults to
	// always ready.
	Ready func(ctx context.Context) []string
	// Snapshot returns the outbox's status for the page. Defaults to none (the page shows
	// only Self).
	Snapshot func(ctx context.Context) (*status.Snapshot, error)
	// Self describes the serving process. Defaults to none.
	Self func() Self
	// Message returns one outbox row for /messages/{message id} (the page the blocked keys
	// link their dead rows to), or store.ErrNoRow. Defaults to none (404).
	Message func(ctx context.Context, id uuid.UUID) (*store.MessageDetail, error)
	// Schema is the schema of the outbox Message reads: the commands the message page
	// suggests name it (--schema) unless it is the default. The status page takes the
	// snapshot's.
	Schema string
	// CacheTTL: snapshots are reused for this long, so that reloading the page does not
	// load the database. Defaults to 2s.
	CacheTTL time.Duration
	// ThroughputSample is how often Self().Published is sampled for the throughput graph.
	// Defaults to 5s.
	ThroughputSample time.Duration
	// Refresh is how often the page reloads itself. Defaults to 5s.
	Refresh time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Server serves the operations endpoints. Create it with Start.
type Server struct {
	cfg Config
	ln  net.Listener
	srv *http.Server

	mu       sync.Mutex
	snap     *status.Snapshot
	snapErr  error
	snapAt   time.Time
	samples  []sample // throughput ring, oldest first
	stopOnce sync.Once
	stop     chan struct{}
	done     chan struct{}
}

type sample struct {
	at        time.Time
	published int64
}

const maxSamples = 60

// Start listens on cfg.Addr and serves until Close.
func Start(cfg *Config) (*Server, error) {
	if cfg == nil || cfg.Addr == "" {
		return nil, errors.New("ops: Config.Addr is required")
	}
	c := *cfg
	if c.CacheTTL == 0 {
		c.CacheTTL = DefaultCacheTTL
	}
	if c.ThroughputSample == 0 {
		c.ThroughputSample = DefaultThroughputSample
	}
	if c.Refresh == 0 {
		c.Refresh = DefaultRefresh
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	ln, err := net.Listen("tcp", c.Addr)
	if err != nil {
		return nil, fmt.Errorf("ops: listen on %s: %w", c.Addr, err)
	}
	if a, ok := ln.Addr().(*net.TCPAddr); ok && !a.IP.IsLoopback() {
		c.Logger.Warn("the operations listener is reachable from other hosts: its status page and /status.json "+
			"have no authentication (listen on 127.0.0.1, or put it behind a proxy)", "addr", ln.Addr().String())
	}
	s := &Server{cfg: c, ln: ln, stop: make(chan struct{}), done: make(chan struct{})}
	s.srv = &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = s.srv.Serve(ln) }()
	go s.sampleLoop()
	return s, nil
}

// Addr is the address the server listens on (useful with port 0).
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the server.
func (s *Server) Close() {
	s.stopOnce.Do(func() {
		close(s.stop)
		<-s.done
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = s.srv.Shutdown(ctx)
	})
}

// Handler returns the server's routes.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	if s.cfg.Gatherer != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(s.cfg.Gatherer, promhttp.HandlerOpts{}))
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", s.readyz)
	mux.HandleFunc("GET /status.json", s.statusJSON)
	mux.HandleFunc("GET /{$}", s.page)
	mux.HandleFunc("GET /messages/{id}", s.message)
	return mux
}

func (s *Server) readyz(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	var problems []string
	if s.cfg.Ready != nil {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		problems = s.cfg.Ready(ctx)
		cancel()
	}
	if len(problems) > 0 {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, strings.Join(problems, "\n"))
		return
	}
	msg := "ok"
	if s.cfg.Self != nil {
		me := s.cfg.Self()
		msg = fmt.Sprintf("ok: %s, partitions held %d", me.Health, len(me.Held))
	}
	fmt.Fprintln(w, msg)
}

// snapshot returns a cached snapshot, refreshing it when older than CacheTTL.
func (s *Server) snapshot(ctx context.Context) (*status.Snapshot, error) {
	if s.cfg.Snapshot == nil {
		return nil, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.snapAt.IsZero() || time.Since(s.snapAt) >= s.cfg.CacheTTL {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		s.snap, s.snapErr = s.cfg.Snapshot(ctx)
		cancel()
		s.snapAt = time.Now()
	}
	return s.snap, s.snapErr
}

func (s *Server) statusJSON(w http.ResponseWriter, r *http.Request) {
	snap, err := s.snapshot(r.Context())
	out := struct {
		Self       *Self            `json:"self"`
		Throughput float64          `json:"throughput_per_second"`
		Snapshot   *status.Snapshot `json:"snapshot"`
		Error      string           `json:"error"`
	}{Snapshot: snap, Throughput: s.throughput(time.Minute)}
	if s.cfg.Self != nil {
		me := s.cfg.Self()
		if me.Held == nil {
			me.Held = []int32{}
		}
		out.Self = &me
	}
	if err != nil {
		out.Error = err.Error()
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(out)
}

func (s *Server) sampleLoop() {
	defer close(s.done)
	if s.cfg.Self == nil {
		<-s.stop
		return
	}
	t := time.NewTicker(s.cfg.ThroughputSample)
	defer t.Stop()
	for {
		s.record(time.Now(), s.cfg.Self().Published)
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
	}
}

func (s *Server) record(at time.Time, published int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.samples = append(s.samples, sample{at: at, published: published})
	if len(s.samples) > maxSamples {
		s.samples = s.samples[len(s.samples)-maxSamples:]
	}
}

// throughput is messages per second over the last window (or what the samples cover).
func (s *Server) throughput(window time.Duration) float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.samples) < 2 {
		return 0
	}
	last := s.samples[len(s.samples)-1]
	first := s.samples[0]
	for _, x := range s.samples {
		if last.at.Sub(x.at) <= window {
			first = x
			break
		}
	}
	d := last.at.Sub(first.at).Seconds()
	if d <= 0 {
		return 0
	}
	return float64(last.published-first.published) / d
}

// rates are the per-interval rates between samples, oldest first.
func (s *Server) rates() []float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []float64
	for i := 1; i < len(s.samples); i++ {
		d := s.samples[i].at.Sub(s.samples[i-1].at).Seconds()
		if d > 0 {
			out = append(out, float64(s.samples[i].published-s.samples[i-1].published)/d)
		}
	}
	return out
}
