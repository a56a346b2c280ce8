package checkback

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/internal/prom"
	"github.com/txoutbox/txoutbox/internal/store"
)

// Check outcomes, the label values of txoutbox_checkback_checks_total.
const (
	OutcomeCommit       = "commit"
	OutcomeRollback     = "rollback"
	OutcomeUnknown      = "unknown"
	OutcomeError        = "error"         // the checker replied with an error (a micro service error)
	OutcomeTimeout      = "timeout"       // no reply within RequestTimeout
	OutcomeNoResponders = "no_responders" // nobody serves the group's subject
	OutcomeMalformed    = "malformed"     // a reply that is not COMMIT, ROLLBACK or UNKNOWN
)

// metrics are the check-back's Prometheus collectors. They always count; they are exported
// only when Config.Registerer is set.
type metrics struct {
	checks      *prometheus.CounterVec
	resolved    *prometheus.CounterVec
	exhausted   prometheus.Counter
	purged      *prometheus.CounterVec
	jobErrors   *prometheus.CounterVec
	jobDuration *prometheus.HistogramVec
	prepared    prometheus.Gauge
	exhaustedN  prometheus.Gauge
	staleReady  prometheus.Gauge
	oldestReady prometheus.Gauge
	groupHalf   *prometheus.GaugeVec
	groupOldest *prometheus.GaugeVec

	groupsMu    sync.Mutex
	shownGroups []string // the group labels the stale job last set
}

// maxGroupSeries bounds the per-group gauges (groups by name).
const maxGroupSeries = 50

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	const ns, sub = "txoutbox", "checkback"
	m := &metrics{
		checks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "checks_total",
			Help: "Checks of stale half messages by outcome: commit, rollback, unknown, error, timeout, no_responders, malformed.",
		}, []string{"outcome"}),
		resolved: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "resolved_total",
			Help: "Half messages the check-back settled, by result: committed, rolled_back (the checker said so), fenced (rolled back under the row lock).",
		}, []string{"result"}),
		exhausted: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "exhausted_total",
			Help: "Half messages that became check_exhausted after MaxChecks inconclusive checks.",
		}),
		purged: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "purged_total",
			Help: "Rows deleted past their retention, by kind: published, rolled_back, dedup.",
		}, []string{"kind"}),
		jobErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "job_errors_total",
			Help: "Job runs that failed, by job: resolve, stale, purge; resolve also counts each producer group whose checks a scheduled pass could not record.",
		}, []string{"job"}),
		jobDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Subsystem: sub, Name: "job_duration_seconds",
			Help:    "Duration of job runs, by job.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}, []string{"job"}),
		prepared: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "prepared_rows",
			Help: "Half messages in state prepared (counted up to 100000 by the stale job).",
		}),
		exhaustedN: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "exhausted_rows",
			Help: "Half messages in state check_exhausted, awaiting an operator (counted by the stale job).",
		}),
		staleReady: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "stale_ready_rows",
			Help: "Ready rows older than StaleReadyAfter (counted up to 100000 by the stale job).",
		}),
		oldestReady: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "oldest_ready_age_seconds",
			Help: "Age of the oldest ready row (0 when none), as of the stale job's last run.",
		}),
		groupHalf: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "half_messages",
			Help: "Open half messages per producer group (the first 50 groups by name) and state: prepared or check_exhausted (counted by the stale job).",
		}, []string{"group", "state"}),
		groupOldest: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "oldest_prepared_age_seconds",
			Help: "Age of the oldest prepared half message per producer group (0 when it has none), as of the stale job's last run.",
		}, []string{"group"}),
	}
	for _, o := range []string{OutcomeCommit, OutcomeRollback, OutcomeUnknown, OutcomeError, OutcomeTimeout, OutcomeNoResponders, OutcomeMalformed} {
		m.checks.WithLabelValues(o)
	}
	for _, r := range []string{"committed", "rolled_back", "fenced"} {
		m.resolved.WithLabelValues(r)
	}
	// The jobs and the purge kinds, so that dashboards and alerts find the families before
	// the first error or purge.
	for _, j := range []string{"resolve", "stale", "purge"} {
		m.jobErrors.WithLabelValues(j)
		m.jobDuration.WithLabelValues(j)
	}
	for _, k := range []string{"published", "rolled_back", "dedup"} {
		m.purged.WithLabelValues(k)
	}
	if err := prom.Register(reg, "checkback",
		prom.Of(&m.checks), prom.Of(&m.resolved), prom.Of(&m.exhausted), prom.Of(&m.purged), prom.Of(&m.jobErrors), prom.Of(&m.jobDuration), prom.Of(&m.prepared), prom.Of(&m.exhaustedN), prom.Of(&m.staleReady), prom.Of(&m.oldestReady), prom.Of(&m.groupHalf), prom.Of(&m.groupOldest)); err != nil {
		return nil, err
	}
	return m, nil
}

// setGroups sets the per-group gauges and deletes those of groups that have no open half
// message any more. A message prepared without a group (fence mode) counts under group "".
func (m *metrics) setGroups(groups []store.GroupHalf) {
	m.groupsMu.Lock()
	defer m.groupsMu.Unlock()
	shown := map[string]bool{}
	for _, g := range groups {
		shown[g.Group] = true
		m.groupHalf.WithLabelValues(g.Group, store.StatePrepared).Set(float64(g.Prepared))
		m.groupHalf.WithLabelValues(g.Group, store.StateCheckExhausted).Set(float64(g.Exhausted))
		m.groupOldest.WithLabelValues(g.Group).Set(g.OldestPrepared.Seconds())
	}
	for _, g := range m.shownGroups {
		if !shown[g] {
			m.groupHalf.DeleteLabelValues(g, store.StatePrepared)
			m.groupHalf.DeleteLabelValues(g, store.StateCheckExhausted)
			m.groupOldest.DeleteLabelValues(g)
		}
	}
	m.shownGroups = m.shownGroups[:0]
	for _, g := range groups {
		m.shownGroups = append(m.shownGroups, g.Group)
	}
}
