package relay

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/natsname"
	"github.com/txoutbox/txoutbox/internal/safetext"
	"github.com/txoutbox/txoutbox/internal/store"
)

// A publish that gets no PubAck within PublishTimeout, "no responders", or a JetStream error
// about the cluster's state right now (outageCodes) is, by itself, ambiguous: the broker may
// not answer (an outage of the relay's NATS or of JetStream), the stream capturing the
// subject may have no leader (an election under way: an outage of that stream), or no stream
// captures the subject at all (the subject's own failure). explainFailures tells them apart by
// asking JetStream about the subject: the stream capturing it (from the streams the relay
// knows, see knownStreams, else JetStream's subject look-up, which the cluster's meta leader
// answers), then that stream's info (one short deadline for a wave):
//
//   - the connection is down, JetStream's subject look-up does not answer, or there was no
//     time left to ask → a broker outage: nothing counted, the relay backs off;
//   - no stream captures the subject (the look-up says so) → the subject's own failure
//     (something that is not a stream took the message without answering, or nobody did);
//   - the stream has a setting that makes it unusable (no_ack) → the subject's own failure:
//     JetStream answered and said why. The stream is remembered (unusableStreams) so that its
//     later rows fail at once, unsent;
//   - otherwise a stream captures the subject and can take publishes: its info does not
//     answer, answers 10008 or names no leader (an election under way), names a leader
//     without a quorum of current replicas (see quorumOf: a leader whose followers are gone
//     answers, and its publishes time out or get 10158 "duplicate message id is in process"
//     when sent again), or answers with a leader (the leader just changed) → an outage of
//     that stream (errStreamUnavailable):
//     nothing counted, its rows left as they are, its keys held, the other streams' rows
//     going on. The stream is remembered (streamOutages): its rows are not sent until its info
//     answers with a leader that has its quorum again;
//   - but "the leader just changed" is allowed leaderGraceWaves waves in a row for one leader
//     named (see leaderStrikes): past that, publishes that time out (or get no responders)
//     while the same leader answers with its quorum are the subject's own failure, with a
//     last_error naming stream and subject. A leader that keeps answering while the stream's publishes keep
//     failing is no election (a single server's stream never has one).
//
// A publish the server refused because the relay's NATS user may not publish to its subject
// never gets here: the server's permission violation fails it at once (ErrPublishDenied, a
// message-level failure; see denied.go).
//
// A subject's own failure is a message-level failure: it counts an attempt and the row waits
// for its retry with backoff. Counting is deliberate. The attempt is what holds back the later
// rows of the row's key (the claim skips a key whose earlier row has attempts > 0 and waits
// for its retry; the batch's heldKeys do the same for the next pipelined batch), the backoff
// is what keeps the row from holding up every batch, and the error stored says what
// happened; after MaxAttempts the row is dead, kept and requeueable. A stream that exists and
// can take publishes never makes its rows fail this way: however long it has no leader (its
// info does not answer, or names none), its rows wait. Messages published to a stream without a PubAck may have been stored; the
// republish of the same id within the duplicate window is dropped by JetStream, and the
// consumer's dedup row absorbs one outside it.

// errNoPubAck marks a publish that timed out while the broker itself answered.
var errNoPubAck = errors.New("no PubAck")

// isAckTimeout reports a publish whose PubAck did not come in time.
func isAckTimeout(err error) bool {
	return errors.Is(err, jetstream.ErrAsyncPublishTimeout) || errors.Is(err, errAckWaitExpired)
}

// streamProbe is what JetStream said about the stream capturing a subject.
type streamProbe struct {
	name      string // "" when no stream captures the subject (or it was not asked)
	info      *jetstream.StreamInfo
	lookupErr error // the look-up by subject failed: JetStream's API did not answer
	infoErr   error // the stream's info failed
	skipped   bool  // no time was left to ask
	// struck: this wave's failures while the info answers with a leader were counted (see
	// leaderStrikes); waves is the count for that leader, this wave included.
	struck bool
	waves  int
	span   time.Duration // how long the series of struck waves has lasted (leaderGraceMin)
}

// explainFailures rewrites the outcome of each ambiguous publish of a wave (isAmbiguous): a
// broker outage, an outage of its stream, or the subject's own failure. See above.
func (r *Relay) explainFailures(ctx context.Context, rows []store.Claimed, wave []int, outs []outcome) {
	var todo []int
	for j, o := range outs {
		if o.err != nil && isAmbiguous(o.err) {
			todo = append(todo, j)
		}
	}
	if len(todo) == 0 {
		return
	}
	if !r.pub.Conn().IsConnected() {
		for _, j := range todo {
			outs[j].err = brokerDown(outs[j].err)
		}
		return
	}
	pctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
	defer cancel()
	bySubject := map[string]*streamProbe{}
	byStream := map[string]*streamProbe{}
	apiDown := false
	for _, j := range todo {
		row := &rows[wave[j]]
		p, ok := bySubject[row.Subject]
		if !ok {
			p = r.probeSubject(pctx, row.Subject, byStream, apiDown)
			bySubject[row.Subject] = p
			if p.lookupErr != nil {
				apiDown = true // ask no more: the subjects not asked yet are broker outages too
			}
		}
		outs[j].err = r.verdict(row.Subject, p, outs[j].err)
	}
}

// probeSubject asks JetStream which stream captures subj and for that stream's info. A stream
// the relay knows (knownStreams) is not looked up again, and a stream already asked about in
// this wave (byStream) is not asked again.
func (r *Relay) probeSubject(ctx context.Context, subj string, byStream map[string]*streamProbe, apiDown bool) *streamProbe {
	name, known := r.known.find(subj)
	if p, ok := byStream[name]; known && ok {
		return p
	}
	if ctx.Err() != nil {
		if known {
			// The wave's probe time went on another stream's info (a leaderless stream's
			// request times out): this known stream was not asked, and counts as asked without
			// an answer, a stream outage, as that one did. Two streams electing at once (their
			// leaders on one node) must not turn into a broker outage that stops the batch.
			p := &streamProbe{name: name, infoErr: ctx.Err()}
			byStream[name] = p
			return p
		}
		return &streamProbe{skipped: true}
	}
	for attempt := 0; ; attempt++ {
		if !known {
			if apiDown {
				return &streamProbe{lookupErr: errors.New("JetStream's API did not answer for another subject")}
			}
			n, err := r.pub.StreamNameBySubject(ctx, subj)
			switch {
			case errors.Is(err, jetstream.ErrStreamNotFound):
				return &streamProbe{}
			case err != nil:
				return &streamProbe{lookupErr: err}
			}
			name = n
			if p, ok := byStream[name]; ok {
				return p
			}
		}
		p := &streamProbe{name: name}
		p.info, p.infoErr = r.streamInfo(ctx, name)
		if errors.Is(p.infoErr, jetstream.ErrStreamNotFound) {
			if known && attempt == 0 {
				known = false // a stream the relay knew was deleted: ask which one captures subj now
				continue
			}
			return &streamProbe{} // deleted between the look-up and the info
		}
		if p.infoErr == nil && known && attempt == 0 && !capturesSubject(&p.info.Config, subj) {
			known = false // its subjects changed: ask which stream captures subj now
			continue
		}
		if p.infoErr == nil {
			if setting, reason := unusable(&p.info.Config); setting != "" {
				r.unusable.put(r, &p.info.Config, subj, setting, reason)
			}
		}
		byStream[name] = p
		return p
	}
}

// connectionLost reports an error of the relay's own NATS connection (closed, reconnecting,
// its buffer refused, closed by the WriteFence), never a timeout: a request that times out
// while the connection is up is what a stream electing a leader gives.
func connectionLost(err error) bool {
	var opErr *net.OpError
	return err != nil && (errors.Is(err, nats.ErrConnectionClosed) ||
		errors.Is(err, nats.ErrConnectionReconnecting) ||
		errors.Is(err, nats.ErrReconnectBufExceeded) ||
		errors.Is(err, nats.ErrDisconnected) ||
		errors.Is(err, nats.ErrConnectionDraining) ||
		errors.Is(err, ErrStaleWrite) ||
		errors.Is(err, net.ErrClosed) ||
		errors.As(err, &opErr))
}

// verdict returns the outcome of an ambiguous publish on subj that failed with err, given
// what JetStream said about its stream: a broker outage, a stream outage, or the subject's
// own (message-level) failure.
func (r *Relay) verdict(subj string, p *streamProbe, err error) error {
	if p.lookupErr != nil || p.skipped || connectionLost(p.infoErr) {
		// The stream's info did not answer because the relay's own connection is down (closed
		// by the write fence after a pause, reconnecting): the broker connection's outage, not
		// a stream without a leader.
		return brokerDown(err)
	}
	if isNotAPubAck(err) {
		// A reply that is not a PubAck is about the subject (a service answers on it), not
		// about the broker: the row fails, like any message failure.
		if p.name == "" {
			return fmt.Errorf("%w: a core NATS responder answered on subject %q instead of JetStream, and no JetStream stream captures it", err, subj)
		}
		return fmt.Errorf("%w: a core NATS responder on subject %q answered before stream %q", err, subj, p.name)
	}
	if p.name == "" {
		if isAckTimeout(err) {
			return fmt.Errorf("%w within %s on subject %q, and no JetStream stream captures it: something that is not a stream "+
				"took the message without answering, or the stream was deleted", errNoPubAck, r.cfg.PublishTimeout, subj)
		}
		return err // describe says that no stream captures the subject
	}
	if p.infoErr == nil {
		if setting, reason := unusable(&p.info.Config); setting != "" {
			return &StreamError{Subject: subj, Stream: p.name, Err: ErrStreamUnusable, Setting: setting, Reason: reason}
		}
	}
	reason, lostQuorum := outageReason(err, p.info, p.infoErr)
	switch {
	case p.infoErr != nil || !hasLeader(p.info):
		r.strikes.reset(p.name) // an election seen: the next leader has its own allowance
	case !canStore(p.info):
		// The leader answers without a quorum of current replicas: it can store nothing
		// (publishes time out, or a republish gets 10158 "in process") until they are back
		// or it steps down. An outage, never its leader's strike.
		r.strikes.reset(p.name)
	case mayLackQuorum(p.info):
		// Not heard from a quorum of its replicas for a while, not yet long enough to say
		// it lost it: an outage wave that counts no strike (nor forgets those counted).
	case isAckTimeout(err) || isNoResponders(err) || isOutageCode(err):
		// The stream answers with a leader (and a quorum): the leader just changed, at most
		// leaderGraceWaves waves in a row for one leader; past that, the subject's own
		// failure. An outage code (10158: a copy of the message "in process" at the leader)
		// that the stream's info contradicts is bounded the same way, so that a copy stuck
		// there costs attempts and backoff instead of holding its key for ever.
		if !p.struck {
			p.struck = true
			p.waves, p.span = r.strikes.strikeSpan(p.name, leaderOf(p.info), subj)
		} else {
			r.strikes.also(p.name, subj)
		}
		// A replicated stream's leader may report its replicas current for seconds after they
		// went (leaderGraceMin); an R1 stream has no quorum to lose.
		clustered := p.info != nil && p.info.Cluster != nil && len(p.info.Cluster.Replicas) > 0
		if p.waves > leaderGraceWaves && (!clustered || p.span >= leaderGraceMin) {
			return r.notAnElection(subj, p, err)
		}
		if clustered {
			reason = fmt.Sprintf("%s (wave %d for leader %s, %s in: allowed for %d waves and at least %s)", reason, p.waves,
				leaderText(p.info), p.span.Round(time.Millisecond), leaderGraceWaves, leaderGraceMin)
		} else {
			reason = fmt.Sprintf("%s (wave %d of the %d allowed for leader %s)", reason, p.waves, leaderGraceWaves, leaderText(p.info))
		}
	}
	subjects := r.known.subjects(p.name)
	if p.info != nil {
		subjects = p.info.Config.Subjects
	}
	r.outages.begin(r, p.name, subjects, subj, reason, lostQuorum)
	return &streamOutageError{stream: p.name, subject: subj, reason: reason, sent: true}
}

// notAnElection is the outcome of a publish on subj that failed with err (no PubAck, or no
// responders) while the info of its stream p named the same leader for more than
// leaderGraceWaves waves in a row: the subject's own failure, naming stream and subject.
func (r *Relay) notAnElection(subj string, p *streamProbe, err error) error {
	what := fmt.Sprintf(" within %s", r.cfg.PublishTimeout)
	switch {
	case isNoResponders(err):
		what = fmt.Sprintf(": no responders (%v)", err)
	case isOutageCode(err):
		what = fmt.Sprintf(": %v", err)
	}
	// errNoPubAck is wrapped, never the publish's own error: a timeout would read as a
	// broker outage, and "no responders" as no stream capturing the subject (describe).
	return fmt.Errorf("%w%s on subject %q, captured by stream %q, while the stream's info answers with leader %s "+
		"(%d publish waves in a row): not a leader election; the relay's NATS user may not be allowed to publish to the subject, "+
		"or something between the relay and the stream drops its publishes", errNoPubAck, what, subj, p.name, leaderText(p.info), p.waves)
}

// leaderText names the leader a stream's info gives, for messages.
func leaderText(info *jetstream.StreamInfo) string {
	if l := leaderOf(info); l != "" {
		return fmt.Sprintf("%q", l)
	}
	return "(a single server's stream)"
}

// capturesSubject reports whether a stream with cfg captures the literal subject subj.
func capturesSubject(cfg *jetstream.StreamConfig, subj string) bool {
	for _, f := range cfg.Subjects {
		if natsname.Covers(f, subj) {
			return true
		}
	}
	return false
}

// unusableRecheck is how long a stream found unusable at run time is believed so before it is
// asked again (when a row of its subjects comes up).
const unusableRecheck = time.Second

// unusableStreams remembers the streams found unusable while the relay runs (a stream edited
// after the start check, or capturing a subject outside Config.Subjects). Their rows fail at
// once without being sent: publishing them would hold up their batch for a publish timeout
// each time, and a no_ack stream would store a copy of each. Logged once per state change.
type unusableStreams struct {
	n  atomic.Int32 // len(m), read without the lock for every row sent
	mu sync.Mutex
	m  map[string]*unusableStream // by stream name
}

type unusableStream struct {
	subjects        []string // the stream's subject filters
	setting, reason string
	checked         time.Time
}

func (u *unusableStreams) put(r *Relay, cfg *jetstream.StreamConfig, subj, setting, reason string) {
	u.mu.Lock()
	if u.m == nil {
		u.m = map[string]*unusableStream{}
	}
	_, known := u.m[cfg.Name]
	u.m[cfg.Name] = &unusableStream{subjects: cfg.Subjects, setting: setting, reason: reason, checked: time.Now()}
	u.n.Store(int32(len(u.m)))
	u.mu.Unlock()
	if !known {
		r.log.Warn("stream cannot take publishes: the rows of its subjects fail without being sent (retried with backoff) until it is fixed",
			"stream", cfg.Name, "setting", setting, "subject", subj)
	}
}

func (u *unusableStreams) forget(r *Relay, name, why string) {
	u.mu.Lock()
	_, known := u.m[name]
	delete(u.m, name)
	u.n.Store(int32(len(u.m)))
	u.mu.Unlock()
	if known {
		r.log.Info("stream no longer known to be unusable: its rows are published again", "stream", name, "why", why)
	}
}

// find returns the name and entry of the remembered stream capturing subj, if any.
func (u *unusableStreams) find(subj string) (string, unusableStream, bool) {
	if u.n.Load() == 0 {
		return "", unusableStream{}, false
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	for name, e := range u.m {
		if capturesSubject(&jetstream.StreamConfig{Subjects: e.subjects}, subj) {
			return name, *e, true
		}
	}
	return "", unusableStream{}, false
}

// knownUnusable returns the error for a row on subj when a stream known to be unusable
// captures it, nil otherwise. A belief older than unusableRecheck is checked first: a stream
// fixed, deleted or not answering is forgotten, and the row is published.
func (r *Relay) knownUnusable(ctx context.Context, subj string) error {
	name, e, ok := r.unusable.find(subj)
	if !ok {
		return nil
	}
	if time.Since(e.checked) >= unusableRecheck {
		pctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
		s, err := r.pub.Stream(pctx, name)
		cancel()
		if err != nil {
			r.unusable.forget(r, name, safetext.Text(err.Error(), 256))
			return nil
		}
		cfg := s.CachedInfo().Config
		setting, reason := unusable(&cfg)
		if setting == "" || !capturesSubject(&cfg, subj) {
			r.unusable.forget(r, name, "its settings changed")
			return nil
		}
		r.unusable.put(r, &cfg, subj, setting, reason)
		e.setting, e.reason = setting, reason
	}
	return &StreamError{Subject: subj, Stream: name, Err: ErrStreamUnusable, Setting: e.setting, Reason: e.reason}
}
