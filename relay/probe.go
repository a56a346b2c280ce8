package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/safetext"
	"github.com/txoutbox/txoutbox/internal/store"
)

// A publish whose PubAck does not come within PublishTimeout is, by itself, ambiguous: the
// broker may have stopped answering (an outage: no attempt counted, the relay backs off), or
// only the stream capturing the subject does not answer (a stream with no_ack, a stream
// without a leader, a subscriber that is not a stream). Treating the second as the first
// stalls every subject behind one, and republishes its messages forever. explainTimeouts
// tells them apart by asking JetStream about the subject (the stream capturing it, then that
// stream's info; one short deadline for a wave):
//
//   - the stream has a setting that makes it unusable (no_ack) → the subject's own failure,
//     whatever the rest of the wave did: JetStream answered and said why. The stream is
//     remembered (unusableStreams) so that its later rows fail at once, unsent, instead of
//     holding up every batch they are in for a publish timeout;
//   - no stream captures the subject → the subject's own failure (something that is not a
//     stream took the message without answering, or the stream was just deleted);
//   - the stream looks usable, or its info does not answer either (a stream without a
//     leader), or there was no time left to ask → the subject's own failure when another
//     publish of the same wave was acknowledged (the broker works; this stream does not),
//     a broker outage otherwise;
//   - the lookup itself fails (JetStream's API does not answer), or the connection is down
//     → a broker outage, as before.
//
// A subject's own failure is a message-level failure: it counts an attempt and the row waits
// for its retry with backoff. Counting is deliberate. The attempt is what holds back the later
// rows of the row's key (the claim skips a key whose earlier row has attempts > 0 and waits
// for its retry; the batch's heldKeys do the same for the next pipelined batch), the backoff
// is what keeps the row from holding up every batch for a publish timeout, and the error
// stored says what happened. A stream that stays silent through MaxAttempts retries (about a
// quarter of an hour with the defaults) makes its rows dead: kept, listed and requeued like
// any dead row, never lost. Messages published to a no_ack stream may be stored even though
// no PubAck came; a later republish of the same id within the duplicate window is dropped
// by JetStream, and the consumer's dedup row absorbs one outside it.

// errNoPubAck marks a publish that timed out while the broker itself answered.
var errNoPubAck = errors.New("no PubAck")

// isAckTimeout reports a publish whose PubAck did not come in time.
func isAckTimeout(err error) bool {
	return errors.Is(err, jetstream.ErrAsyncPublishTimeout) || errors.Is(err, errAckWaitExpired)
}

// streamProbe is what JetStream said about the stream capturing a subject.
type streamProbe struct {
	name      string // "" when no stream captures the subject (or it was not asked)
	cfg       jetstream.StreamConfig
	lookupErr error // the lookup by subject failed: JetStream's API did not answer
	infoErr   error // the stream's info failed
	skipped   bool  // no time was left to ask
}

// explainTimeouts rewrites the outcome of each timed-out publish of a wave that is the
// subject's own failure into a message-level error; the others stay broker errors. See above.
func (r *Relay) explainTimeouts(ctx context.Context, rows []store.Claimed, wave []int, outs []outcome) {
	acked := false
	var timedOut []int
	for j, o := range outs {
		switch {
		case o.err == nil:
			acked = true
		case isAckTimeout(o.err):
			timedOut = append(timedOut, j)
		}
	}
	if len(timedOut) == 0 || !r.pub.Conn().IsConnected() {
		return
	}
	pctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
	defer cancel()
	bySubject := map[string]*streamProbe{}
	var found []*streamProbe // probes that found a stream and its configuration
	apiDown := false
	for _, j := range timedOut {
		row := &rows[wave[j]]
		p, ok := bySubject[row.Subject]
		if !ok {
			p = r.probeSubject(pctx, row.Subject, found, apiDown)
			bySubject[row.Subject] = p
			if p.lookupErr != nil {
				apiDown = true // ask no more: the subjects not asked yet stay broker errors
			}
			if p.name != "" && p.infoErr == nil {
				found = append(found, p)
			}
		}
		if err := r.subjectFailure(row.Subject, p, acked, outs[j].err); err != nil {
			outs[j].err = err
		}
	}
}

// probeSubject asks JetStream which stream captures subj and how it is configured. A stream
// already found whose subjects capture subj answers without asking (streams of one account
// never overlap).
func (r *Relay) probeSubject(ctx context.Context, subj string, found []*streamProbe, apiDown bool) *streamProbe {
	for _, p := range found {
		if capturesSubject(&p.cfg, subj) {
			return p
		}
	}
	if apiDown {
		return &streamProbe{lookupErr: errors.New("JetStream's API did not answer for another subject")}
	}
	if ctx.Err() != nil {
		return &streamProbe{skipped: true}
	}
	name, err := r.pub.StreamNameBySubject(ctx, subj)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return &streamProbe{}
	case err != nil:
		return &streamProbe{lookupErr: err}
	}
	p := &streamProbe{name: name}
	s, err := r.pub.Stream(ctx, name)
	if err != nil {
		p.infoErr = err
		return p
	}
	p.cfg = s.CachedInfo().Config
	if setting, reason := unusable(&p.cfg); setting != "" {
		r.unusable.put(r, &p.cfg, subj, setting, reason)
	}
	return p
}

// subjectFailure returns the message-level error for a publish on subj that timed out, or
// nil when the timeout stays a broker error.
func (r *Relay) subjectFailure(subj string, p *streamProbe, acked bool, timeout error) error {
	if p.lookupErr != nil {
		return nil
	}
	if p.name != "" && p.infoErr == nil {
		if setting, reason := unusable(&p.cfg); setting != "" {
			return &StreamError{Subject: subj, Stream: p.name, Err: ErrStreamUnusable, Setting: setting, Reason: reason}
		}
	}
	wait := r.cfg.PublishTimeout.String()
	if p.name == "" && !p.skipped {
		return fmt.Errorf("%w within %s on subject %q, and no JetStream stream captures it: something that is not a stream "+
			"took the message without answering, or the stream was deleted", errNoPubAck, wait, subj)
	}
	if !acked {
		return nil // nothing in the wave was acknowledged: the broker may be down
	}
	switch {
	case p.skipped:
		return fmt.Errorf("%w within %s on subject %q while other publishes of the batch were acknowledged; "+
			"there was no time left to ask JetStream about its stream (the message may have been stored)", errNoPubAck, wait, subj)
	case p.infoErr != nil:
		return fmt.Errorf("%w within %s from stream %q (capturing %q) while other publishes of the batch were acknowledged, "+
			"and the stream's info did not answer either (%s): a stream without a leader? (the message may have been stored)",
			errNoPubAck, wait, p.name, subj, safetext.Text(p.infoErr.Error(), 256))
	}
	return fmt.Errorf("%w within %s from stream %q (capturing %q) while other publishes of the batch were acknowledged; "+
		"the stream answers and its settings allow publishes: a slow stream, or one changing leader? "+
		"(the message may have been stored; %v)", errNoPubAck, wait, p.name, subj, timeout)
}

// capturesSubject reports whether a stream with cfg captures the literal subject subj.
func capturesSubject(cfg *jetstream.StreamConfig, subj string) bool {
	for _, f := range cfg.Subjects {
		if covers(f, subj) {
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
