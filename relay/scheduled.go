package relay

// Delayed messages (outbox.Message.DeliverAt). Scheduled rows are outside the claim's index;
// before claiming, the relay promotes the rows that fell due to ready (store.Promote: an index
// range scan that stops at the first row not yet due, row and key locks only tried, never
// waited on) and learns how long until the next one falls due, so that an idle relay wakes for
// it instead of sleeping out its poll interval. Every relay promotes, whatever partitions it
// holds: promotion only makes rows ready, and concurrent promotions skip each other's rows.

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/internal/prom"
	"github.com/txoutbox/txoutbox/internal/store"
)

// scheduler is the relay's promotion state; only the run loop touches it.
type scheduler struct {
	// last is when the last promotion ran; full says it left due rows, so that the next claim
	// promotes again at once.
	last time.Time
	full bool
	// next is when the next scheduled row falls due (zero: none known).
	next time.Time
	// follow is what the last promotion found more of: the keys with several due rows,
	// promoted all in the next pass (store.FollowOf).
	follow store.Follow
	// rounds counts the promotions run (tests count them: an idle relay promotes once per
	// PollMin at most, unless a row falls due).
	rounds int
}

// scheduledMetrics are the delayed messages' collectors.
//
//	relay_scheduled_promoted_total       counter: scheduled rows this relay made ready
//	relay_scheduled_lateness_seconds     histogram: due → PubAck of delayed messages (due: the
//	                                     later of the delivery time and the insert, half
//	                                     message commit or last reschedule)
//	outbox_messages{state="scheduled"}   (sampled, in metrics.rows)
//	outbox_next_scheduled_seconds        gauge, sampled: seconds until the earliest scheduled
//	                                     row is due (negative: overdue; 0 when there is none)
type scheduledMetrics struct {
	promoted prometheus.Counter
	lateness prometheus.Histogram
	nextDue  prometheus.Gauge
}

func newScheduledMetrics(reg prometheus.Registerer) (*scheduledMetrics, error) {
	m := &scheduledMetrics{
		promoted: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "scheduled_promoted_total",
			Help: "Delayed messages this relay made ready when they fell due.",
		}),
		lateness: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "txoutbox", Subsystem: "relay", Name: "scheduled_lateness_seconds",
			Help:    "Time from when a delayed message became due to its PubAck: from its delivery time, or from its insert (the start of the producer's transaction) or last reschedule when that came later (a delivery time already past then is no lateness).",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 20),
		}),
		nextDue: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "txoutbox", Subsystem: "outbox", Name: "next_scheduled_seconds",
			Help: "Seconds until the earliest scheduled (delayed) message of the whole outbox is due (the later of its delivery time and its insert or last reschedule); negative when it is overdue (beyond a poll interval: no relay is running, or its key is held by an open transaction), 0 when there is none. Sampled.",
		}),
	}
	if err := prom.Register(reg, "relay", prom.Of(&m.promoted), prom.Of(&m.lateness), prom.Of(&m.nextDue)); err != nil {
		return nil, err
	}
	return m, nil
}

// claimPromoting claims, first promoting the due scheduled rows in the same round trip when a
// promotion is due: at most once per PollMin, unless the last one left due rows or the next
// row it knew of fell due.
func (r *Relay) claimPromoting(ctx context.Context, db store.DBTX, a store.ClaimArgs) ([]store.Claimed, error) {
	now := time.Now()
	if !r.sched.full && now.Sub(r.sched.last) < r.cfg.PollMin && (r.sched.next.IsZero() || now.Before(r.sched.next)) {
		return r.q.Claim(ctx, db, a)
	}
	r.sched.last = now
	r.sched.rounds++
	p, rows, err := r.q.PromoteAndClaim(ctx, db, store.PromoteLimit, r.sched.follow, a)
	if err != nil {
		return nil, err
	}
	r.promoted(now, p)
	return rows, nil
}

// promoted records what a promotion did.
func (r *Relay) promoted(now time.Time, p store.Promotion) {
	r.sched.full = p.More
	r.sched.follow = store.FollowOf(p)
	r.sched.next = time.Time{}
	if p.HasNext {
		r.sched.next = now.Add(p.Next)
	}
	if p.Moved > 0 {
		r.sm.promoted.Add(float64(p.Moved))
	}
}

// capWait shortens an idle wait so that the relay wakes when the next scheduled row falls due
// (never shorter than PollMin: a due row a promotion skipped is taken at a later pass).
func (r *Relay) capWait(wait time.Duration) time.Duration {
	if r.sched.next.IsZero() {
		return wait
	}
	return max(min(wait, time.Until(r.sched.next)), r.cfg.PollMin)
}

// sampleScheduled sets the scheduled gauges.
func (r *Relay) sampleScheduled(ctx context.Context) error {
	s, err := r.q.SampleScheduled(ctx, r.pool, r.cfg.SampleLimit)
	if err != nil {
		return fmt.Errorf("sample scheduled: %w", err)
	}
	r.m.rows.WithLabelValues(store.StateScheduled).Set(float64(s.Count))
	r.sm.nextDue.Set(s.NextDueSeconds) // exact (a Duration would saturate at 292 years), negative when overdue, 0 when there is none
	return nil
}

// observeLateness records a delayed message's PubAck: the time since it became due, the later
// of its delivery time and its commit (or its last reschedule), so that a delivery time the
// caller chose in the past is not counted as the relay's lateness (store.Claimed.DueAt).
func (r *Relay) observeLateness(row *store.Claimed) {
	if !row.DueAt.IsZero() {
		r.sm.lateness.Observe(max(time.Since(row.DueAt).Seconds(), 0))
	}
}
