package relay

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/internal/prom"
	"github.com/txoutbox/txoutbox/internal/store"
)

// metrics are the relay's Prometheus collectors. They always count; they are exported only
// when Config.Registerer is set.
//
// Families (all prefixed txoutbox_):
//
//	relay_published_total, relay_duplicates_total, relay_publish_failures_total{kind},
//	relay_dead_total                     counters, per batch
//	relay_batch_size, relay_commit_to_publish_seconds, relay_claim_seconds,
//	relay_settle_seconds                 histograms, per batch
//	relay_partitions_held, relay_partition_target, relay_relays,
//	relay_partition_changes_total{change}, relay_partition_count_mismatch
//	                                     the partition sharing, per lease round
//	relay_health{state}                  1 for the relay's current Health, 0 for the others
//	relay_stream_unavailable{stream}     1 while the relay holds a stream's rows back as
//	                                     unavailable (no leader), 0 for the other streams it
//	                                     knows; set as it changes, synced every sample
//	relay_stream_window_short{stream}    1 while a stream published to keeps duplicates for
//	                                     less than RequiredDuplicateWindow (windows.go)
//	relay_ready_backlog{partition}, relay_oldest_ready_age_seconds{partition}
//	                                     the held partitions' backlog, sampled
//	outbox_messages{state}, outbox_oldest_ready_age_seconds, outbox_next_scheduled_seconds,
//	outbox_subject_ready{subject}, outbox_subject_oldest_ready_age_seconds{subject}
//	                                     the whole outbox, sampled (the same on every relay:
//	                                     aggregate with max, not sum); the subject families
//	                                     keep the maxSubjectSeries subjects with the most
//	                                     ready rows among the sampled ones
//	postgres_oldest_xact_age_seconds, postgres_xmin_horizon_age_xids,
//	postgres_prepared_xacts, postgres_oldest_prepared_xact_age_seconds
//	                                     what holds back VACUUM of the outbox, sampled
//
// Sampled gauges come from a periodic bounded query (Config.SampleInterval,
// Config.SampleLimit), never from the publishing path.
type metrics struct {
	published  prometheus.Counter
	duplicates prometheus.Counter
	failures   *prometheus.CounterVec
	dead       prometheus.Counter
	unsettled  prometheus.Counter
	batchSize  prometheus.Histogram
	latency    prometheus.Histogram
	claimDur   prometheus.Histogram
	settleDur  prometheus.Histogram
	partitions prometheus.Gauge
	target     prometheus.Gauge
	relays     prometheus.Gauge
	changes    *prometheus.CounterVec
	mismatch   prometheus.Gauge
	health     *prometheus.GaugeVec
	// streamUnavailable is set under the outages' lock (see streamOutages).
	streamUnavailable *prometheus.GaugeVec
	windowShort       *prometheus.GaugeVec // see windows.go

	backlog    *prometheus.GaugeVec
	oldestPart *prometheus.GaugeVec
	rows       *prometheus.GaugeVec
	oldest     prometheus.Gauge
	subjects   *prometheus.GaugeVec
	oldestSubj *prometheus.GaugeVec
	sampleErrs prometheus.Counter

	// shownSubjects are the subject labels the last sample set (only the sample loop uses it).
	shownSubjects []string
	oldestXact    prometheus.Gauge
	xminAge       prometheus.Gauge
	prepared      prometheus.Gauge
	oldestPrep    prometheus.Gauge
	horizonError  prometheus.Counter
}

// maxSubjectSeries bounds the per-subject gauges: the subjects with the most ready rows among
// the sampled ones (a subject that carries an id in a token would otherwise make a series per
// id).
const maxSubjectSeries = 50

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	relay := func(name, help string) prometheus.Opts {
		return prometheus.Opts{Namespace: "txoutbox", Subsystem: "relay", Name: name, Help: help}
	}
	m := &metrics{
		published: prometheus.NewCounter(prometheus.CounterOpts(relay("published_total",
			"Outbox rows published to JetStream and settled."))),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts(relay("duplicates_total",
			"PubAcks that reported a duplicate (a republish absorbed by the stream's duplicate window)."))),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts(relay("publish_failures_total",
			"Failed publishes by kind: message (counts an attempt) or broker (outage, no attempt counted).")), []string{"kind"}),
		dead: prometheus.NewCounter(prometheus.CounterOpts(relay("dead_total",
			"Rows that became dead after MaxAttempts failed publishes."))),
		unsettled: prometheus.NewCounter(prometheus.CounterOpts(relay("unsettled_total",
			"Rows this relay published whose settle did not find them ready: settled by a relay that took the partition over, or hidden from the relay's role by row-level security (then published again and again)."))),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "batch_size",
			Help:    "Rows per claimed batch.",
			Buckets: []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000},
		}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "commit_to_publish_seconds",
			Help:    "Time from a row becoming ready (its insert, or a half message's commit) to its PubAck.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18),
		}),
		claimDur: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "claim_seconds",
			Help:    "Time of one claim statement (its rows read), per claim that ran.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16),
		}),
		settleDur: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "settle_seconds",
			Help:    "Time of one settle statement, per settled batch.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16),
		}),
		partitions: prometheus.NewGauge(prometheus.GaugeOpts(relay("partitions_held",
			"Partitions this relay holds the lease of."))),
		target: prometheus.NewGauge(prometheus.GaugeOpts(relay("partition_target",
			"This relay's fair share of the partitions (partitions / live relays, rounded up for the oldest)."))),
		relays: prometheus.NewGauge(prometheus.GaugeOpts(relay("relays",
			"Live relays sharing the partitions, this one included, at the last lease round."))),
		changes: prometheus.NewCounterVec(prometheus.CounterOpts(relay("partition_changes_total",
			"Partition leases taken, released (rebalancing or shutdown), lost (connection gone), fenced (another relay ended the session of this relay, frozen, counted by the relay that fenced it), or expired (once per batch this relay stopped sending because its lease had ended or a partition was released or lost since the claim).")), []string{"change"}),
		mismatch: prometheus.NewGauge(prometheus.GaugeOpts(relay("partition_count_mismatch",
			"1 while a live relay is configured with another partition count (a misconfiguration), else 0."))),
		health: newHealthGauge(),
		streamUnavailable: prometheus.NewGaugeVec(prometheus.GaugeOpts(relay("stream_unavailable",
			"1 while this relay holds back the rows of a stream as unavailable (no leader: publishes get no responders or no PubAck while JetStream answers; no attempt counted), 0 for the other streams it knows. Cleared by the stream's next acknowledged publish, or when none of its rows came up for 30s.")), []string{"stream"}),
		windowShort: prometheus.NewGaugeVec(prometheus.GaugeOpts(relay("stream_window_short",
			"1 while a stream this relay published to keeps duplicates for less than RequiredDuplicateWindow (a republish past its window is stored twice), 0 for the other streams it checked. Checked when the relay first publishes to a stream and every 10 minutes.")), []string{"stream"}),
		backlog: prometheus.NewGaugeVec(prometheus.GaugeOpts(relay("ready_backlog",
			"Ready rows of each partition this relay holds, counted among the oldest SampleLimit ready rows.")), []string{"partition"}),
		oldestPart: prometheus.NewGaugeVec(prometheus.GaugeOpts(relay("oldest_ready_age_seconds",
			"Age of the oldest ready row of each partition this relay holds (0 when it has none).")), []string{"partition"}),
		rows: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "txoutbox", Subsystem: "outbox", Name: "messages",
			Help: "Outbox rows by state (ready, dead, prepared, check_exhausted, scheduled), each counted up to SampleLimit. The whole outbox: every relay reports the same value.",
		}, []string{"state"}),
		oldest: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "txoutbox", Subsystem: "outbox", Name: "oldest_ready_age_seconds",
			Help: "Age of the oldest ready row of the whole outbox (0 when there is none).",
		}),
		subjects: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "txoutbox", Subsystem: "outbox", Name: "subject_ready",
			Help: "Ready rows per subject among the oldest SampleLimit ready rows (the 50 subjects with the most). The whole outbox: every relay reports the same value.",
		}, []string{"subject"}),
		oldestSubj: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "txoutbox", Subsystem: "outbox", Name: "subject_oldest_ready_age_seconds",
			Help: "Age of the oldest ready row per subject, for the subjects of txoutbox_outbox_subject_ready.",
		}, []string{"subject"}),
		sampleErrs: prometheus.NewCounter(prometheus.CounterOpts(relay("sample_errors_total",
			"Failed backlog samples (the sampled gauges keep their last value)."))),
		oldestXact: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "txoutbox", Subsystem: "postgres", Name: "oldest_xact_age_seconds",
			Help: "Age of the oldest open transaction in the outbox's database that holds a snapshot or a transaction id (0 when none): while it is open VACUUM cannot remove the rows the relay settled. Sessions of other roles count only when the relay's role may see them (pg_read_all_stats).",
		}),
		xminAge: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "txoutbox", Subsystem: "postgres", Name: "xmin_horizon_age_xids",
			Help: "Age in transaction ids of the xmin horizon: the oldest of open transactions, prepared transactions and replication slots.",
		}),
		prepared: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "txoutbox", Subsystem: "postgres", Name: "prepared_xacts",
			Help: "Two-phase transactions prepared in the outbox's database and not yet committed or rolled back.",
		}),
		oldestPrep: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "txoutbox", Subsystem: "postgres", Name: "oldest_prepared_xact_age_seconds",
			Help: "Age of the oldest prepared transaction (0 when none).",
		}),
		horizonError: prometheus.NewCounter(prometheus.CounterOpts(relay("horizon_sample_errors_total",
			"Failed samples of the xmin horizon (its gauges keep their last value)."))),
	}
	// Make the labelled families visible before their first event.
	for _, k := range []string{"message", "broker"} {
		m.failures.WithLabelValues(k)
	}
	for _, c := range []string{"taken", "released", "lost"} {
		m.changes.WithLabelValues(c)
	}
	m.setHealth(healthStarting)
	if err := prom.Register(reg, "relay",
		prom.Of(&m.published), prom.Of(&m.duplicates), prom.Of(&m.failures), prom.Of(&m.dead), prom.Of(&m.unsettled), prom.Of(&m.batchSize), prom.Of(&m.latency), prom.Of(&m.partitions), prom.Of(&m.target), prom.Of(&m.relays), prom.Of(&m.changes), prom.Of(&m.mismatch), prom.Of(&m.health), prom.Of(&m.streamUnavailable), prom.Of(&m.windowShort), prom.Of(&m.backlog), prom.Of(&m.oldestPart), prom.Of(&m.rows), prom.Of(&m.oldest), prom.Of(&m.subjects), prom.Of(&m.oldestSubj), prom.Of(&m.sampleErrs),
		prom.Of(&m.claimDur), prom.Of(&m.settleDur), prom.Of(&m.oldestXact), prom.Of(&m.xminAge), prom.Of(&m.prepared), prom.Of(&m.oldestPrep), prom.Of(&m.horizonError)); err != nil {
		return nil, err
	}
	return m, nil
}

// newHealthGauge returns the txoutbox_relay_health family (see New and RegisterHealth).
func newHealthGauge() *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "txoutbox", Subsystem: "relay", Name: "health",
		Help: "1 for the relay's current state (starting, ok, standby, postgres_unavailable, nats_unavailable), 0 for the others."}, []string{"state"})
}

// RegisterHealth registers the relay's health gauge, txoutbox_relay_health{state}, on reg with
// the state starting: for a process that serves its metrics before it can create the relay
// (the relay binary, while it waits for PostgreSQL or NATS at start), so that an alert on the
// gauge sees a relay that never gets going. New, given the same registerer, adopts the gauge.
func RegisterHealth(reg prometheus.Registerer) error {
	m := &metrics{health: newHealthGauge()}
	m.setHealth(healthStarting)
	return prom.Register(reg, "relay", prom.Of(&m.health))
}

// setHealth sets the health gauges: 1 for h, 0 for every other state.
func (m *metrics) setHealth(h healthState) {
	for i, name := range healthStates {
		v := 0.0
		if healthState(i) == h {
			v = 1
		}
		m.health.WithLabelValues(string(name)).Set(v)
	}
}

// sampleLoop refreshes the sampled gauges every SampleInterval until ctx ends.
func (r *Relay) sampleLoop(ctx context.Context) {
	t := time.NewTicker(r.cfg.SampleInterval)
	defer t.Stop()
	failing := false
	for {
		r.syncStreamGauge()
		err := r.sampleOnce(ctx)
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			r.m.sampleErrs.Inc()
			if !failing {
				r.log.Warn("backlog sampling failed; the backlog gauges keep their last value", "err", err)
			}
			failing = true
		case failing:
			failing = false
			r.log.Info("backlog sampling works again")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// sampleOnce runs the bounded sampling queries and sets the gauges.
func (r *Relay) sampleOnce(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, max(r.cfg.SampleInterval, 5*time.Second))
	defer cancel()
	st, err := r.q.SampleStates(ctx, r.pool, r.cfg.SampleLimit)
	if err != nil {
		return fmt.Errorf("sample states: %w", err)
	}
	r.m.rows.WithLabelValues(store.StateReady).Set(float64(st.Ready))
	r.m.rows.WithLabelValues(store.StateDead).Set(float64(st.Dead))
	r.m.rows.WithLabelValues(store.StatePrepared).Set(float64(st.Prepared))
	r.m.rows.WithLabelValues(store.StateCheckExhausted).Set(float64(st.CheckExhausted))
	r.m.oldest.Set(st.OldestReady.Seconds())
	if err := r.sampleScheduled(ctx); err != nil {
		return err
	}
	r.sampleHorizon(ctx)

	subjects, err := r.q.SampleSubjects(ctx, r.pool, r.cfg.SampleLimit, maxSubjectSeries)
	if err != nil {
		return fmt.Errorf("sample subjects: %w", err)
	}
	shown := map[string]bool{}
	for _, s := range subjects {
		shown[s.Subject] = true
		r.m.subjects.WithLabelValues(s.Subject).Set(float64(s.Ready))
		r.m.oldestSubj.WithLabelValues(s.Subject).Set(s.Oldest.Seconds())
	}
	for _, label := range r.m.shownSubjects {
		if !shown[label] {
			r.m.subjects.DeleteLabelValues(label)
			r.m.oldestSubj.DeleteLabelValues(label)
		}
	}
	r.m.shownSubjects = r.m.shownSubjects[:0]
	for _, s := range subjects {
		r.m.shownSubjects = append(r.m.shownSubjects, s.Subject)
	}

	held := r.Partitions()
	var parts []store.PartitionSample
	if len(held) > 0 {
		if parts, err = r.q.SamplePartitions(ctx, r.pool, r.cfg.Partitions, r.cfg.SampleLimit); err != nil {
			return fmt.Errorf("sample partitions: %w", err)
		}
	}
	byPart := map[int32]store.PartitionSample{}
	for _, p := range parts {
		byPart[p.Partition] = p
	}
	isHeld := map[string]bool{}
	for _, p := range held {
		label := strconv.Itoa(int(p))
		isHeld[label] = true
		s := byPart[p]
		r.m.backlog.WithLabelValues(label).Set(float64(s.Ready))
		r.m.oldestPart.WithLabelValues(label).Set(s.Oldest.Seconds())
	}
	// Partitions this relay no longer holds are another relay's to report.
	for p := 0; p < r.cfg.Partitions; p++ {
		if label := strconv.Itoa(p); !isHeld[label] {
			r.m.backlog.DeleteLabelValues(label)
			r.m.oldestPart.DeleteLabelValues(label)
		}
	}
	return nil
}

// sampleHorizon sets the xmin horizon gauges. A failure (a role that may not read the
// catalog views, say) is counted and leaves them as they were: it does not fail the sample.
func (r *Relay) sampleHorizon(ctx context.Context) {
	h, err := r.q.XminHorizon(ctx, r.pool)
	if err != nil {
		r.m.horizonError.Inc()
		return
	}
	r.m.oldestXact.Set(h.OldestXact.Seconds())
	r.m.xminAge.Set(float64(h.XminAge()))
	r.m.prepared.Set(float64(h.Prepared))
	r.m.oldestPrep.Set(h.OldestPrepared.Seconds())
}
