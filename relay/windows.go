package relay

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/safetext"
)

// The duplicate window of every stream the relay publishes to, while it runs. CheckStreams
// checks the streams of Config.Subjects at start; the streams the relay's PubAcks name are
// checked too, once when first seen and again every windowRecheck (a stream created later, a
// subject outside Config.Subjects, a window shortened after the start): a window shorter than
// RequiredDuplicateWindow is a warning (once per stream and window) and
// txoutbox_relay_stream_window_short{stream} 1 until it is long enough again. Not a refusal: the
// relay is running and its messages are stored; a republish past the window would be stored
// twice, which the idempotent consumer absorbs.

// windowRecheck is how often a stream's window is looked at again.
const windowRecheck = 10 * time.Minute

// windowWatch holds the streams the relay published to and what their windows were.
type windowWatch struct {
	last atomic.Pointer[string] // the stream last noted: the publishing path's shortcut

	mu      sync.Mutex
	streams map[string]*windowState
	kick    chan struct{} // a stream was seen for the first time
}

type windowState struct {
	checked time.Time     // zero: not yet
	short   time.Duration // the window found short (0: long enough, or not checked)
}

func newWindowWatch() *windowWatch {
	return &windowWatch{streams: map[string]*windowState{}, kick: make(chan struct{}, 1)}
}

// note records that a PubAck named stream. Cheap when it is the stream of the last call.
func (w *windowWatch) note(stream string) {
	if p := w.last.Load(); p != nil && *p == stream || stream == "" {
		return
	}
	w.mu.Lock()
	if _, ok := w.streams[stream]; !ok {
		w.streams[stream] = &windowState{}
		select {
		case w.kick <- struct{}{}:
		default:
		}
	}
	w.mu.Unlock()
	w.last.Store(&stream)
}

// checked records that CheckStreams found stream's window long enough at start.
func (w *windowWatch) checked(stream string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.streams[stream] = &windowState{checked: time.Now()}
}

// forget drops stream (deleted).
func (w *windowWatch) forget(stream string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.streams, stream)
	if p := w.last.Load(); p != nil && *p == stream {
		w.last.Store(nil)
	}
}

// due returns the streams to check now.
func (w *windowWatch) due(now time.Time) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for name, s := range w.streams {
		if s.checked.IsZero() || now.Sub(s.checked) >= windowRecheck {
			out = append(out, name)
		}
	}
	return out
}

// watchWindows checks the windows of the streams the relay publishes to, as they are first
// seen and every windowRecheck, until ctx ends.
func (r *Relay) watchWindows(ctx context.Context) {
	t := time.NewTicker(time.Minute)
	defer t.Stop()
	for {
		r.checkWindows(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-r.windows.kick:
		}
	}
}

// checkWindows looks at the duplicate window of each stream due for it (see windowWatch). A
// stream that does not answer is looked at again at the next pass.
func (r *Relay) checkWindows(ctx context.Context) {
	required := r.cfg.RequiredDuplicateWindow()
	for _, name := range r.windows.due(time.Now()) {
		pctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
		s, err := r.js.Stream(pctx, name)
		cancel()
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			// Deleted: forgotten, its series with it (a short window's alert would fire for
			// ever); seen again if a PubAck names it again.
			r.windows.forget(name)
			r.m.windowShort.DeleteLabelValues(name)
			continue
		}
		if err != nil {
			if ctx.Err() == nil {
				r.log.Debug("duplicate window check: the stream does not answer", "stream", name, "err", safetext.Text(err.Error(), 256))
			}
			continue
		}
		w := s.CachedInfo().Config.Duplicates
		r.windows.mu.Lock()
		st := r.windows.streams[name]
		was := st.short
		st.checked = time.Now()
		if w < required {
			st.short = w
		} else {
			st.short = 0
		}
		r.windows.mu.Unlock()
		switch {
		case w < required && w != was:
			r.m.windowShort.WithLabelValues(name).Set(1)
			r.log.Warn("a stream the relay publishes to keeps duplicates for less than the relay may republish: "+
				"a republish past its window is stored twice (the consumer's dedup absorbs it); raise its duplicate window, "+
				"or lower PublishTimeout, PollMax, BackoffMax, HandoverAfter or LeaseInterval", "stream", name, "duplicate_window", w.String(), "required", required.String())
		case w >= required && was != 0:
			r.m.windowShort.WithLabelValues(name).Set(0)
			r.log.Info("a stream's duplicate window is long enough again", "stream", name, "duplicate_window", w.String())
		case w >= required:
			r.m.windowShort.WithLabelValues(name).Set(0)
		}
	}
}
