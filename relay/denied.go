package relay

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
)

// A publish the relay's NATS user may not make is dropped by the server, which tells the
// connection so asynchronously (-ERR 'Permissions Violation for Publish to "<subject>"'):
// nats.go hands that to the connection's error handler only, and the publish's PubAckFuture
// waits out its timeout. Taken for a timeout, it would look like an outage of the subject's
// stream (the stream answers with a leader; see explainFailures): a configuration error
// reported as an election, its rows never failing. So the relay watches the connection's
// errors (watchPermissions chains a handler onto the connection's own) and fails the
// publishes on a denied subject as soon as the server says so, as a message-level failure
// (ErrPublishDenied): an attempt counted, a last_error naming the subject, retried with
// backoff, dead after MaxAttempts, until the user is allowed to publish there. For
// deniedRecheck after a violation, the subject's rows fail the same way without being sent.

// ErrPublishDenied: the NATS server refused a publish because the relay's NATS user may not
// publish to the subject (or with the relay's reply subject). The error also matches
// nats.ErrPermissionViolation. The row's publish fails as a message-level failure (retried
// with backoff, dead after MaxAttempts): grant the user the permission, then requeue the
// dead rows. Run returns it at start, instead of waiting, when the server denies the relay's
// user the JetStream API requests of the start-up stream check (or the reply subjects
// JetStream answers on).
var ErrPublishDenied = errors.New("relay: the NATS server denies the relay's user this publish")

var (
	// nats-server quotes the subject as Go's %q does: \, " and characters that are not
	// printable come escaped (a subject may hold them: outbox.ValidateSubject allows them).
	deniedSubjectRe = regexp.MustCompile(`(?i)permissions violation for publish to ("(?:[^"\\]|\\.)*")`)
	deniedReplyRe   = regexp.MustCompile(`(?i)permissions violation for publish with reply of "(?:[^"\\]|\\.)*"`)
	deniedSubRe     = regexp.MustCompile(`(?i)permissions violation for subscription to ("(?:[^"\\]|\\.)*")`)
)

// deniedSubjects records the permission violations the server reported on the relay's
// connection: by subject, and for the relay's reply subjects (which deny every publish).
type deniedSubjects struct {
	inbox  string       // the connection's inbox prefix: a subscription denied under it denies every PubAck
	n      atomic.Int32 // violations seen; read without the lock on the publish path
	mu     sync.Mutex
	m      map[string]deniedAt // subject → the last violation; "" for the replies (publishing with one, or subscribing to the inbox)
	notify chan struct{}       // closed (and replaced) at every violation
}

type deniedAt struct {
	at   time.Time
	text string // the server's words
}

// maxDeniedSubjects bounds the subjects remembered; past it, the oldest is forgotten.
const maxDeniedSubjects = 1024

// deniedRecheck is how long a subject the server denied is believed denied: its rows fail
// without being sent meanwhile (each denied publish would keep one of nats.go's pending
// PubAck slots until PublishTimeout, and enough of them would stall every publish). After it,
// the next row of the subject is sent again, and fails again at once while the permission is
// missing.
const deniedRecheck = time.Second

// observe records err if it is a publish permission violation.
func (d *deniedSubjects) observe(err error) {
	if !errors.Is(err, nats.ErrPermissionViolation) {
		return
	}
	text := err.Error()
	subj := ""
	if m := deniedSubjectRe.FindStringSubmatch(text); m != nil {
		u, err := strconv.Unquote(m[1])
		if err != nil {
			return // not the server's quoting: no subject to fail
		}
		subj = u
	} else if deniedReplyRe.FindStringSubmatch(text) == nil {
		// A subscription: the relay's only if it is to the connection's inbox, where the
		// PubAcks and JetStream's answers come back (denied, none ever arrives).
		m := deniedSubRe.FindStringSubmatch(text)
		if m == nil || d.inbox == "" {
			return
		}
		if u, err := strconv.Unquote(m[1]); err != nil || !strings.HasPrefix(u, d.inbox) {
			return
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.m == nil {
		d.m = map[string]deniedAt{}
	}
	if _, ok := d.m[subj]; !ok && len(d.m) >= maxDeniedSubjects {
		oldest, at := "", time.Time{}
		for s, e := range d.m {
			if at.IsZero() || e.at.Before(at) {
				oldest, at = s, e.at
			}
		}
		delete(d.m, oldest)
	}
	d.m[subj] = deniedAt{at: time.Now(), text: text}
	d.n.Add(1)
	if d.notify != nil {
		close(d.notify)
		d.notify = nil
	}
}

// changed returns a channel closed at the next violation.
func (d *deniedSubjects) changed() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.notify == nil {
		d.notify = make(chan struct{})
	}
	return d.notify
}

// check returns an ErrPublishDenied error when the server reported a violation for a publish
// on subj (or for the relay's reply subject) at or after since, nil otherwise.
func (d *deniedSubjects) check(subj string, since time.Time) error {
	if d.n.Load() == 0 {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if e, ok := d.m[subj]; ok && !e.at.Before(since) {
		return fmt.Errorf("%w: %w: the relay's NATS user may not publish to subject %q (the server said %q); "+
			"grant it the permission to publish there (its rows are retried with backoff, and dead after max attempts)",
			ErrPublishDenied, nats.ErrPermissionViolation, subj, e.text)
	}
	if e, ok := d.m[""]; ok && !e.at.Before(since) {
		return fmt.Errorf("%w: %w: the relay's NATS user may not use the reply subjects JetStream's PubAcks come back on "+
			"(the server said %q; publishing to %q); allow it to publish with replies and to subscribe to its inbox (%s.>)",
			ErrPublishDenied, nats.ErrPermissionViolation, e.text, subj, d.inboxOr())
	}
	return nil
}

// recent returns the ErrPublishDenied error of subj if the server denied it within
// deniedRecheck (then its row is not sent), nil otherwise.
func (d *deniedSubjects) recent(subj string) error {
	if d.n.Load() == 0 {
		return nil
	}
	return d.check(subj, time.Now().Add(-deniedRecheck))
}

// permissionWatch is the error handler chained onto one connection for the relays using it.
type permissionWatch struct {
	prev   nats.ErrHandler
	relays map[*deniedSubjects]struct{}
}

var (
	watchMu sync.Mutex
	watches = map[*nats.Conn]*permissionWatch{}
)

// watchPermissions makes d observe the errors of nc, chaining a handler onto nc's own (which
// keeps being called). stop undoes it; the last relay on nc to stop puts nc's handler back.
// A handler set on nc after watchPermissions replaces the watch: set it before relay.New.
func watchPermissions(nc *nats.Conn, d *deniedSubjects) (stop func()) {
	if nc == nil {
		return func() {}
	}
	watchMu.Lock()
	defer watchMu.Unlock()
	w := watches[nc]
	if w == nil {
		w = &permissionWatch{prev: nc.ErrorHandler(), relays: map[*deniedSubjects]struct{}{}}
		watches[nc] = w
		prev := w.prev
		nc.SetErrorHandler(func(c *nats.Conn, sub *nats.Subscription, err error) {
			if sub == nil { // a publish violation comes without a subscription
				watchMu.Lock()
				for d := range w.relays {
					d.observe(err)
				}
				watchMu.Unlock()
			}
			if prev != nil {
				prev(c, sub, err)
			}
		})
	}
	w.relays[d] = struct{}{}
	var once sync.Once
	return func() {
		once.Do(func() {
			watchMu.Lock()
			defer watchMu.Unlock()
			delete(w.relays, d)
			if len(w.relays) == 0 && watches[nc] == w {
				delete(watches, nc)
				nc.SetErrorHandler(w.prev)
			}
		})
	}
}

// deniedAPI returns an ErrPublishDenied error when the server denied, at or after since, a
// request of the relay's to the JetStream API ($JS.API.…, or the domain's $JS.<domain>.API.…):
// the relay's NATS user may not ask JetStream what the relay needs, which no wait fixes.
func (d *deniedSubjects) deniedAPI(since time.Time) error {
	if d.n.Load() == 0 {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for subj, e := range d.m {
		if subj == "" && !e.at.Before(since) {
			return fmt.Errorf("%w: %w: the relay's NATS user may not use the reply subjects JetStream answers on (the server said %q): "+
				"allow it to publish with replies and to subscribe to its inbox (%s.>)", ErrPublishDenied, nats.ErrPermissionViolation, e.text, d.inboxOr())
		}
		if strings.HasPrefix(subj, "$JS.") && strings.Contains(subj, ".API.") && !e.at.Before(since) {
			return fmt.Errorf("%w: %w: the relay's NATS user may not use the JetStream API (the server said %q): "+
				"allow it to publish to $JS.API.> (or the domain's $JS.<domain>.API.>) and to receive the replies",
				ErrPublishDenied, nats.ErrPermissionViolation, e.text)
		}
	}
	return nil
}

// inboxOr is the connection's inbox prefix, or nats.go's default.
func (d *deniedSubjects) inboxOr() string {
	if d.inbox == "" {
		return strings.TrimSuffix(nats.InboxPrefix, ".")
	}
	return d.inbox
}

// inboxPrefix is nc's inbox prefix (nats.CustomInboxPrefix, else nats.go's _INBOX), "" without
// a connection.
func inboxPrefix(nc *nats.Conn) string {
	if nc == nil {
		return ""
	}
	if p := nc.Opts.InboxPrefix; p != "" {
		return strings.TrimSuffix(p, ".")
	}
	return strings.TrimSuffix(nats.InboxPrefix, ".")
}
