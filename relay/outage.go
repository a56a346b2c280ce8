package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/jserr"
	"github.com/txoutbox/txoutbox/internal/safetext"
)

// A stream of a JetStream cluster elects a leader when its leader dies, steps down or loses
// its quorum. Until one is elected — seconds, or as long as a quorum of its replicas is
// missing — nobody subscribes to its subjects: publishes get "no responders" at once (or time
// out when the leader died with them in flight), its info does not answer (or a replica
// answers 10008 "JetStream system temporarily unavailable"), while the cluster's meta leader
// still answers the account info and the subject lookup. That is an outage of that stream,
// never a failure of its messages: its rows are left as they are (no attempt, no backoff, no
// last_error), its keys are held, and the rows of the other streams go on. See
// explainFailures for how the relay tells it from "no stream captures this subject".

// errStreamUnavailable: a stream capturing rows' subjects has no leader (an election is under
// way), or its leader just changed (its publishes time out while its info answers with a
// leader: at most three publish waves in a row for one leader), while JetStream
// itself answers. Its rows are left as they are, no attempt counted, and published once it
// acknowledges again; the other streams' rows go on. Never returned to a caller: the run
// loop waits it out, and the gauge txoutbox_relay_stream_unavailable{stream} shows it.
var errStreamUnavailable = errors.New("relay: stream unavailable")

// streamOutageError is the outcome of a row whose stream is unavailable: its publish met the
// outage (sent), or it was not sent for an outage already known.
type streamOutageError struct {
	stream, subject, reason string
	sent                    bool
}

func (e *streamOutageError) Error() string {
	return fmt.Sprintf("%v: stream %q (capturing %q) %s", errStreamUnavailable, e.stream, e.subject, e.reason)
}

func (e *streamOutageError) Unwrap() error { return errStreamUnavailable }

// errJetStreamDown marks a publish outcome that is a broker outage: NATS or JetStream's API
// did not answer the relay's questions about it.
var errJetStreamDown = errors.New("relay: JetStream did not answer")

// outageCodes are the JetStream API errors that are about a stream's (or the cluster's)
// state right now, not about the message (see internal/jserr).
var outageCodes = jserr.OutageCodes

// isOutageCode reports a JetStream API error in outageCodes.
func isOutageCode(err error) bool { return jserr.IsOutageCode(err) }

// knownStreams maps the streams the relay has seen to the subjects they capture: learned by
// the start check (CheckStreams) and by every look-up while the relay runs. It lets the relay
// name the stream of a subject without JetStream's subject look-up, and so tell "the stream
// capturing this subject has no leader" from "no stream captures it" while the cluster is
// electing. A stream that JetStream says does not exist is forgotten.
type knownStreams struct {
	mu sync.Mutex
	m  map[string][]string // stream name → subject filters
}

func (k *knownStreams) learn(cfg *jetstream.StreamConfig) {
	if cfg == nil || cfg.Name == "" {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.m == nil {
		k.m = map[string][]string{}
	}
	k.m[cfg.Name] = append([]string(nil), cfg.Subjects...)
}

func (k *knownStreams) forget(name string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.m, name)
}

// names returns the names of the known streams.
func (k *knownStreams) names() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := make([]string, 0, len(k.m))
	for name := range k.m {
		out = append(out, name)
	}
	return out
}

// subjects returns the subject filters of a known stream (nil if unknown).
func (k *knownStreams) subjects(name string) []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.m[name]
}

// find returns the known stream capturing the literal subject subj.
func (k *knownStreams) find(subj string) (string, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for name, subjects := range k.m {
		if capturesSubject(&jetstream.StreamConfig{Subjects: subjects}, subj) {
			return name, true
		}
	}
	return "", false
}

// outageRecheck is how often the relay asks a stream in outage whether it has a leader
// again (when a row of its subjects comes up); outageAsk bounds that question. outageUnmet is
// how long an outage is remembered without a row of its stream coming up: while the relay
// holds such rows it meets them at least every outageRecheck, so an outage unmet that long
// is one whose rows went elsewhere (their partitions taken over, the rows requeued or purged).
// It is forgotten (see syncStreamGauge): the stream's gauge goes back to 0, and its next row is
// sent and starts the outage again if it fails.
const (
	outageRecheck = 250 * time.Millisecond
	outageAsk     = 500 * time.Millisecond
	outageUnmet   = 30 * time.Second
)

// streamOutages remembers the streams found unavailable. Their rows are not sent (they would
// only get "no responders", or hold up their batch for a publish timeout) until the stream's
// info answers with a leader; the next publish on one of its subjects that is acknowledged
// ends the outage. One warning when an outage starts, one info line when it ends. The gauge
// txoutbox_relay_stream_unavailable{stream} is 1 while a stream is here, set under mu with
// every change (and synced with the known streams by syncStreamGauge).
type streamOutages struct {
	n     atomic.Int32 // len(m), read without the lock for every row sent and acknowledged
	mu    sync.Mutex
	m     map[string]*streamOutage // by stream name
	shown map[string]bool          // the stream labels the gauge has a series for
}

type streamOutage struct {
	subjects []string
	reason   string
	since    time.Time
	checked  time.Time // when the stream was last found unavailable
	met      time.Time // when a row of the stream last came up (begin, knownOutage, askOutages)
	probing  bool      // its info answered with a leader that can store: rows are sent again
	// lostQuorum: the outage was found to be a lost quorum (logged once, see quorumLost).
	lostQuorum bool
	asking     bool // askOutages is asking its info
	// The rows held back for the outage, left out of the relay's claims while it lasts (see
	// exclusions), so that they cannot fill every batch and stop the other streams: unkeyed
	// rows by id, keyed ones by key (a key's later rows must not go before its held row).
	// Claimed under lease generation gen.
	heldIDs  map[int64]struct{}
	heldKeys map[string]struct{}
	gen      uint64
}

// maxHeld bounds the rows (ids and keys) an outage leaves out of the claims; past it, further
// rows of the stream are claimed and held back batch by batch, as before a stream's rows were
// left out.
const maxHeld = 20000

// hold records a row held back for the outage of stream name (claimed under lease generation
// gen), so that claims leave it out until the stream answers with a leader again.
func (o *streamOutages) hold(name string, id int64, key string, gen uint64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	e := o.m[name]
	if e == nil || e.probing {
		return
	}
	if e.gen != gen {
		e.heldIDs, e.heldKeys, e.gen = nil, nil, gen
	}
	if len(e.heldIDs)+len(e.heldKeys) >= maxHeld {
		return
	}
	if key == "" {
		if e.heldIDs == nil {
			e.heldIDs = map[int64]struct{}{}
		}
		e.heldIDs[id] = struct{}{}
		return
	}
	if e.heldKeys == nil {
		e.heldKeys = map[string]struct{}{}
	}
	e.heldKeys[key] = struct{}{}
}

// exclusions returns the ids and keys the claim leaves out, of the outages not being probed
// whose rows were held under lease generation gen (rows held under another generation may be
// another relay's now: their sets are dropped).
func (o *streamOutages) exclusions(gen uint64) (ids []int64, keys []string) {
	if o.n.Load() == 0 {
		return nil, nil
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, e := range o.m {
		if e.gen != gen {
			e.heldIDs, e.heldKeys, e.gen = nil, nil, gen
		}
		if e.probing {
			continue
		}
		for id := range e.heldIDs {
			ids = append(ids, id)
		}
		for k := range e.heldKeys {
			keys = append(keys, k)
		}
	}
	return ids, keys
}

// askOutages asks, in the background, the info of each stream whose held rows the claims
// leave out and whose last answer is older than outageRecheck (knownOutage does it for rows
// that come up; these do not): once it answers with a leader, its rows are claimed and sent
// again, and the first acknowledged publish ends the outage.
func (r *Relay) askOutages() {
	if r.outages.n.Load() == 0 {
		return
	}
	o := &r.outages
	type ask struct {
		name string
		e    *streamOutage
	}
	var asks []ask
	o.mu.Lock()
	for name, e := range o.m {
		if e.probing || e.asking || len(e.heldIDs)+len(e.heldKeys) == 0 || time.Since(e.checked) < outageRecheck {
			continue
		}
		e.asking = true
		asks = append(asks, ask{name, e})
	}
	o.mu.Unlock()
	for _, a := range asks {
		// Not the claim's context: the claim returns (and cancels it) long before. Run waits
		// for the ask, which ends when Run's context does.
		r.run.goBackground(min(r.probeTimeout(), outageAsk), func(actx context.Context) {
			info, err := r.streamInfo(actx, a.name)
			o.mu.Lock()
			defer o.mu.Unlock()
			e := a.e
			e.asking = false
			e.met = time.Now() // its rows are still held here: not an outage to forget
			switch {
			case err == nil && canStore(info), errors.Is(err, jetstream.ErrStreamNotFound):
				e.probing = true
				r.Wake()
			default:
				e.checked = time.Now()
				o.quorumLost(r, a.name, e, info)
			}
		})
	}
}

// quorumLost records, for the outage e of stream name whose info (nil if it did not answer)
// says it cannot store yet, that it has lost its quorum, logged once per outage; o.mu is
// held.
func (o *streamOutages) quorumLost(r *Relay, name string, e *streamOutage, info *jetstream.StreamInfo) {
	if info == nil || !hasLeader(info) || canStore(info) || e.lostQuorum {
		return
	}
	e.lostQuorum = true
	e.reason = lostQuorumText("its publishes wait", info)
	r.log.Warn(fmt.Sprintf("stream %s %s", name, e.reason), "stream", name)
}

// setGauge sets the stream's unavailable gauge; o.mu is held.
func (o *streamOutages) setGauge(r *Relay, name string, v float64) {
	if o.shown == nil {
		o.shown = map[string]bool{}
	}
	o.shown[name] = true
	r.m.streamUnavailable.WithLabelValues(name).Set(v)
}

// begin records that stream name is unavailable; subj is the subject that showed it, reason
// says why, and lostQuorum says that the stream's leader answers without a quorum of current
// replicas (logged once per outage, as a warning).
func (o *streamOutages) begin(r *Relay, name string, subjects []string, subj, reason string, lostQuorum bool) {
	now := time.Now()
	o.mu.Lock()
	if o.m == nil {
		o.m = map[string]*streamOutage{}
	}
	e, known := o.m[name]
	if !known {
		e = &streamOutage{since: now}
		o.m[name] = e
		o.n.Store(int32(len(o.m)))
	}
	if len(subjects) > 0 {
		e.subjects = subjects
	} else if len(e.subjects) == 0 {
		e.subjects = []string{subj}
	}
	e.reason, e.checked, e.met, e.probing = reason, now, now, false
	o.setGauge(r, name, 1)
	lost := lostQuorum && !e.lostQuorum
	e.lostQuorum = e.lostQuorum || lost
	o.mu.Unlock()
	if lost && known {
		r.log.Warn(fmt.Sprintf("stream %s %s", name, reason), "stream", name, "subject", subj)
		return
	}
	if !known {
		r.log.Warn("stream unavailable: its messages wait, no attempt counted, until it acknowledges again (the other streams go on)",
			"stream", name, "subject", subj, "why", reason)
	} else {
		r.log.Debug("stream still unavailable", "stream", name, "subject", subj, "why", reason)
	}
}

// succeededExcept ends the outages of the streams capturing a subject in acked (each
// acknowledged a publish of a wave), except those of the streams in down (a publish of the
// same wave met their outage).
func (o *streamOutages) succeededExcept(r *Relay, acked []string, down map[string]bool) {
	if o.n.Load() == 0 || len(acked) == 0 {
		return
	}
	type ended struct {
		name string
		e    *streamOutage
	}
	var over []ended
	o.mu.Lock()
	for name, e := range o.m {
		if down[name] {
			continue
		}
		cfg := &jetstream.StreamConfig{Subjects: e.subjects}
		for _, subj := range acked {
			if capturesSubject(cfg, subj) {
				delete(o.m, name)
				o.setGauge(r, name, 0)
				over = append(over, ended{name, e})
				break
			}
		}
	}
	o.n.Store(int32(len(o.m)))
	o.mu.Unlock()
	for _, x := range over {
		r.log.Info("stream available again: its messages are published", "stream", x.name,
			"outage", time.Since(x.e.since).Round(time.Millisecond).String())
	}
}

// find returns the stream in outage capturing subj, if any.
func (o *streamOutages) find(subj string) (string, *streamOutage) {
	if o.n.Load() == 0 {
		return "", nil
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	for name, e := range o.m {
		if capturesSubject(&jetstream.StreamConfig{Subjects: e.subjects}, subj) {
			return name, e
		}
	}
	return "", nil
}

// knownOutage returns the error for a row on subj when the stream capturing it is known to be
// unavailable, nil when the row is to be sent. At most every outageRecheck the stream's info
// is asked for: once it answers with a leader, rows are sent again.
func (r *Relay) knownOutage(ctx context.Context, subj string) error {
	name, e := r.outages.find(subj)
	if e == nil {
		return nil
	}
	r.outages.mu.Lock()
	probing, due, reason := e.probing, time.Since(e.checked) >= outageRecheck, e.reason
	e.met = time.Now()
	r.outages.mu.Unlock()
	if probing {
		return nil
	}
	if due {
		actx, cancel := context.WithTimeout(ctx, min(r.probeTimeout(), outageAsk))
		info, err := r.streamInfo(actx, name)
		cancel()
		r.outages.mu.Lock()
		switch {
		case err == nil && canStore(info):
			e.probing = true
		case errors.Is(err, jetstream.ErrStreamNotFound):
			e.probing = true // deleted: the publish will say what is left
		default:
			e.checked = time.Now()
			r.outages.quorumLost(r, name, e, info)
		}
		probing = e.probing
		r.outages.mu.Unlock()
		if probing {
			return nil
		}
	}
	return &streamOutageError{stream: name, subject: subj, reason: reason}
}

// syncStreamGauge sets txoutbox_relay_stream_unavailable for every stream the relay knows or
// holds as unavailable (1 while it does, 0 otherwise), drops the series of streams it no
// longer knows, and forgets an outage whose rows have not come up for outageUnmet (logged).
// The sample loop runs it.
func (r *Relay) syncStreamGauge() {
	known := r.known.names()
	o := &r.outages
	o.mu.Lock()
	var forgotten []string
	want := map[string]float64{}
	for _, name := range known {
		want[name] = 0
	}
	for name, e := range o.m {
		if time.Since(e.met) >= outageUnmet {
			delete(o.m, name)
			forgotten = append(forgotten, name)
			continue
		}
		want[name] = 1
	}
	o.n.Store(int32(len(o.m)))
	for name := range o.shown {
		if _, ok := want[name]; !ok {
			r.m.streamUnavailable.DeleteLabelValues(name)
			delete(o.shown, name)
		}
	}
	for name, v := range want {
		o.setGauge(r, name, v)
	}
	o.mu.Unlock()
	for _, name := range forgotten {
		r.log.Info("stream outage forgotten: no row of the stream came up for a while (its partitions were taken over, or its rows requeued or purged); its next row is sent",
			"stream", name, "unmet_for", outageUnmet.String())
	}
}

// streamInfo asks JetStream for a stream's info and learns its subjects.
func (r *Relay) streamInfo(ctx context.Context, name string) (*jetstream.StreamInfo, error) {
	s, err := r.pub.Stream(ctx, name)
	if err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			r.known.forget(name)
		}
		return nil, err
	}
	info := s.CachedInfo()
	r.known.learn(&info.Config)
	return info, nil
}

// leaderGraceWaves bounds the "its leader just changed" allowance: the publish waves in a row,
// for one leader named in the stream's info, whose publishes on the stream time out (or get no
// responders) while that info answers, taken as an outage of the stream. A leader that just
// took over may miss the publishes sent to its predecessor or before it subscribed, once or
// twice; one that keeps answering the stream's info while the stream's publishes keep timing
// out is no election: the relay's user may not publish there (the server said nothing the
// relay saw; see ErrPublishDenied), or something else drops them. Past it, the publish fails
// as the subject's own failure (an attempt, a last_error naming stream and subject, backoff,
// dead after MaxAttempts).
const leaderGraceWaves = 3

// leaderGraceMin is the least time a clustered stream's series of struck waves lasts before
// its publishes are the subject's own failure, however many waves it took: a leader whose
// replicas just went (a quorum loss) still answers its info with them current, and its
// publishes get 10158 "in process" or time out, for up to replicaSeenWithin before its info
// says so (and a wave comes every few hundred milliseconds: three of them fit in a second).
// Twice that leaves the info time to catch up; a leader that keeps answering with its quorum
// for longer while the stream's publishes fail is no election. A stream without replicas (R1,
// or a single server's) has no quorum to lose and no such delay.
const leaderGraceMin = 2 * replicaSeenWithin

// leaderStrikes counts, per stream, the waves whose publishes timed out while the stream's
// info answered with the same leader (see leaderGraceWaves). The count starts again when the
// info names another leader or none (an election seen), or leaderStrikeExpiry after the last
// wave that struck, and ends when a subject that struck gets a PubAck (the failures were the
// leader change's). A single server's stream (no
// cluster info) has the leader "".
type leaderStrikes struct {
	n  atomic.Int32 // len(m), read without the lock for every acknowledged wave
	mu sync.Mutex
	m  map[string]*leaderStrike // by stream name
}

type leaderStrike struct {
	leader   string
	first    time.Time // the first wave of the series
	last     time.Time // the last wave that struck
	waves    int
	subjects map[string]struct{} // the subjects whose publishes struck (at most maxStruck)
}

const maxStruck = 64

// strike records a wave whose publishes on subj, of stream name, failed while its info named
// leader, and returns the waves in a row for that leader (this one included).
func (s *leaderStrikes) strike(name, leader, subj string) int {
	waves, _ := s.strikeSpan(name, leader, subj)
	return waves
}

// strikeSpan is strike, also returning how long the series has lasted, from its first wave to
// this one, read under the same lock.
func (s *leaderStrikes) strikeSpan(name, leader, subj string) (int, time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]*leaderStrike{}
	}
	e := s.m[name]
	now := time.Now()
	if e == nil || e.leader != leader || now.Sub(e.last) > leaderStrikeExpiry {
		e = &leaderStrike{leader: leader, first: now, subjects: map[string]struct{}{}}
		s.m[name] = e
		s.n.Store(int32(len(s.m)))
	}
	e.waves++
	e.last = now
	s.struck(e, subj)
	return e.waves, e.last.Sub(e.first)
}

// leaderStrikeExpiry ends a series of struck waves: the next wave that strikes more than this
// after the last one starts a new count. The waves of one cause come one after another (a
// failed row is retried within seconds); without it, a stream whose subjects never repeat
// (one per entity) would add up timeouts days apart, none ever acknowledged, and a later
// leader change would find its allowance spent.
const leaderStrikeExpiry = 2 * time.Minute

// also records one more subject that struck in the current wave of stream name.
func (s *leaderStrikes) also(name, subj string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.m[name]; e != nil {
		s.struck(e, subj)
	}
}

func (s *leaderStrikes) struck(e *leaderStrike, subj string) {
	if len(e.subjects) < maxStruck {
		e.subjects[subj] = struct{}{}
	}
}

// reset forgets the count of stream name: it was seen without a leader.
func (s *leaderStrikes) reset(name string) {
	if s.n.Load() == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, name)
	s.n.Store(int32(len(s.m)))
}

// acked forgets the count of every stream one of whose subjects that struck was acknowledged.
func (s *leaderStrikes) acked(subjects []string) {
	if s.n.Load() == 0 || len(subjects) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for name, e := range s.m {
		for _, subj := range subjects {
			if _, ok := e.subjects[subj]; ok {
				delete(s.m, name)
				break
			}
		}
	}
	s.n.Store(int32(len(s.m)))
}

// leaderOf returns the leader a stream's info names ("" for a single server's stream).
func leaderOf(info *jetstream.StreamInfo) string {
	if info.Cluster == nil {
		return ""
	}
	return info.Cluster.Leader
}

// hasLeader reports whether a stream's info names a leader (a stream of a single server has
// no cluster info and is its own leader).
func hasLeader(info *jetstream.StreamInfo) bool {
	return info.Cluster == nil || info.Cluster.Leader != ""
}

// replicaSeenWithin: a replica its stream's leader has not heard from for longer is not
// counted current (canStore). A leader whose followers are gone still reports them current
// (their lag is 0: nothing commits) until it steps down for lost quorum, ten seconds later;
// how long ago it heard from them is what tells. nats-server's raft leader heartbeats on a
// one-second ticker when it has sent nothing else, so an idle stream's followers may answer
// nearly two seconds apart, more on a loaded machine: four seconds leaves that margin before
// a healthy stream is taken as unable to store (and its rows held back).
const replicaSeenWithin = 4 * time.Second

// replicaSuspectAfter: a publish that failed while a replica has not been heard from for
// longer counts no strike of its leader (leaderGraceWaves): the quorum may be going, and
// must not be taken for the subject's own failure before replicaSeenWithin says so.
const replicaSuspectAfter = 2 * time.Second

// quorumOf returns, for the info of a clustered stream that names a leader, how many of its
// replicas are current (the leader, and each replica the leader reports current, online and
// heard from within replicaSeenWithin) and how many it has (replicas still joining or
// leaving not counted), and whether that is fewer than a quorum: such a leader answers the
// stream's info and takes publishes, and can store none of them. A single server's stream
// (no cluster info), an R1 stream and a leaderless one have no quorum to lose (lost false).
func quorumOf(info *jetstream.StreamInfo) (current, of int, lost bool) {
	return quorumWithin(info, replicaSeenWithin)
}

// quorumWithin is quorumOf with replicas counted current when heard from within seen.
func quorumWithin(info *jetstream.StreamInfo, seen time.Duration) (current, of int, lost bool) {
	if info == nil || info.Cluster == nil || info.Cluster.Leader == "" {
		return 0, 0, false
	}
	of, current = 1, 1
	for _, p := range info.Cluster.Replicas {
		if p == nil || p.Pending {
			continue
		}
		of++
		if p.Current && !p.Offline && p.Active <= seen {
			current++
		}
	}
	return current, of, of > 1 && current < of/2+1
}

// canStore reports whether a stream's info says it can store publishes: it names a leader,
// and that leader has a quorum of current replicas.
func canStore(info *jetstream.StreamInfo) bool {
	_, _, lost := quorumOf(info)
	return hasLeader(info) && !lost
}

// mayLackQuorum reports whether a stream's leader has not heard from a quorum of its
// replicas for replicaSuspectAfter: its failed publishes count no strike (see verdict).
func mayLackQuorum(info *jetstream.StreamInfo) bool {
	_, _, lost := quorumWithin(info, replicaSuspectAfter)
	return hasLeader(info) && lost
}

// lostQuorumText says that a stream whose info is info has lost its quorum.
func lostQuorumText(published string, info *jetstream.StreamInfo) string {
	current, of, _ := quorumOf(info)
	return fmt.Sprintf("has lost its quorum: %d of %d replicas current (its leader %q answers and cannot store: %s); waiting for its replicas",
		current, of, leaderOf(info), published)
}

// outageReason says why a stream whose publishes failed with err is taken as unavailable,
// from what its info said (infoErr; info when it answered), and whether that is a lost
// quorum: a leader that answers and cannot store.
func outageReason(err error, info *jetstream.StreamInfo, infoErr error) (reason string, lostQuorum bool) {
	var apiErr *jetstream.APIError
	published := "its publishes time out"
	switch {
	case isNoResponders(err):
		published = "nobody takes its publishes (no responders)"
	case errors.As(err, &apiErr):
		published = fmt.Sprintf("its publishes are refused for now (%v)", safetext.Text(err.Error(), 200))
	}
	switch {
	case infoErr != nil && errors.As(infoErr, &apiErr) && outageCodes[apiErr.ErrorCode] != "":
		return fmt.Sprintf("has no leader: %s and its info says %q (%d): a leader election under way?",
			published, outageCodes[apiErr.ErrorCode], apiErr.ErrorCode), false
	case infoErr != nil:
		return fmt.Sprintf("has no leader: %s and its info does not answer (%s): a leader election under way?",
			published, safetext.Text(infoErr.Error(), 200)), false
	case info != nil && !hasLeader(info):
		return fmt.Sprintf("has no leader: %s and its info names none: a leader election under way?", published), false
	case info != nil && !canStore(info):
		return lostQuorumText(published, info), true
	case errors.As(err, &apiErr) && apiErr.ErrorCode == 10158:
		return fmt.Sprintf("%s while its info answers with leader %q: an earlier publish of the message is still waiting for the stream's replicas", published, leaderOf(info)), false
	}
	return fmt.Sprintf("%s while its info answers with a leader: its leader just changed?", published), false
}

// isAmbiguous reports a publish outcome that explainFailures must explain: it may be an
// outage of the broker, of the stream, or the subject's own failure.
func isAmbiguous(err error) bool {
	return isAckTimeout(err) || isNoResponders(err) || isOutageCode(err) || isNotAPubAck(err)
}

// isNotAPubAck reports a reply that is not a PubAck: something other than JetStream (a core
// NATS service on the subject) answered the publish.
func isNotAPubAck(err error) bool { return errors.Is(err, jetstream.ErrInvalidJSAck) }

// brokerDown marks err as a broker outage.
func brokerDown(err error) error {
	if isBrokerError(err) {
		return err
	}
	return fmt.Errorf("%w: %w", errJetStreamDown, err)
}
