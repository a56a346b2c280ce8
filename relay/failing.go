package relay

import (
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/txoutbox/txoutbox/internal/store"
)

// maxFailingSubjects bounds the subjects whose failing state is remembered; past it, every
// further failure on another subject is logged as the first.
const maxFailingSubjects = 1024

// failingSubjects turns message-level publish failures into one log line per state change of
// a subject: a warning when it starts failing, an info line when a publish on it succeeds
// again. The failures in between (every retry of every row) are logged at debug level.
type failingSubjects struct {
	n  atomic.Int32 // len(m), read without the lock on the success path
	mu sync.Mutex
	m  map[string]int64 // subject → failures since it started failing
}

// failed records a failure of row; errText is the error as stored in last_error.
func (f *failingSubjects) failed(log *slog.Logger, row *store.Claimed, errText string, willRetry bool) {
	f.mu.Lock()
	if f.m == nil {
		f.m = make(map[string]int64)
	}
	n, known := f.m[row.Subject]
	if known || len(f.m) < maxFailingSubjects {
		f.m[row.Subject] = n + 1
		f.n.Store(int32(len(f.m)))
	}
	f.mu.Unlock()
	attrs := []any{"subject", row.Subject, "message_id", row.MessageID.String(), "attempt", row.Attempts + 1, "will_retry", willRetry, "err", errText}
	if known {
		log.Debug("publish failed", attrs...)
		return
	}
	if !willRetry {
		// MaxAttempts reached (1, say, or a permanent failure): the row is dead, not retried.
		log.Warn("publishing on a subject fails; this message is not retried (it becomes dead), the subject's others are retried with backoff until their attempts run out (further failures are logged at debug level until one succeeds)", attrs...)
		return
	}
	log.Warn("publishing on a subject fails; its messages are retried with backoff (further failures are logged at debug level until one succeeds)", attrs...)
}

func (f *failingSubjects) succeeded(log *slog.Logger, subject string) {
	if f.n.Load() == 0 {
		return
	}
	f.mu.Lock()
	n, known := f.m[subject]
	if known {
		delete(f.m, subject)
		f.n.Store(int32(len(f.m)))
	}
	f.mu.Unlock()
	if known {
		log.Info("publishing on a subject succeeds again", "subject", subject, "failures", n)
	}
}
