package checkback

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/txoutbox/txoutbox/internal/cmdline"
)

// countLimit bounds the counting scans of the stale job.
const countLimit = 100000

// StaleResult is what one run of the stale job found.
type StaleResult struct {
	// StaleReady counts ready rows older than StaleReadyAfter (up to 100000).
	StaleReady int64
	// OldestReady is the age of the oldest ready row (0 when there is none).
	OldestReady time.Duration
	// Prepared and Exhausted count half messages in those states (up to 100000 each).
	Prepared  int64
	Exhausted int64
}

// staleState remembers what was last logged, so that the job logs state changes: the start
// and the end of a stale backlog (its size in between is the gauge's, not the log's), and each
// change of the check_exhausted count.
type staleState struct {
	mu        sync.Mutex
	stale     int64
	exhausted int64
}

// staleOnce counts stale ready rows and half messages and logs changes. It reads only: nothing
// is published or changed because of it.
func (c *CheckBack) staleOnce(ctx context.Context) (StaleResult, error) {
	var r StaleResult
	var err error
	r.StaleReady, r.OldestReady, err = c.q.StaleReady(ctx, c.db, c.cfg.StaleReadyAfter, countLimit)
	if err != nil {
		return r, fmt.Errorf("count stale ready rows: %w", err)
	}
	r.Prepared, r.Exhausted, err = c.q.CountHalf(ctx, c.db, countLimit)
	if err != nil {
		return r, fmt.Errorf("count half messages: %w", err)
	}
	c.m.staleReady.Set(float64(r.StaleReady))
	c.m.oldestReady.Set(r.OldestReady.Seconds())
	c.m.prepared.Set(float64(r.Prepared))
	c.m.exhaustedN.Set(float64(r.Exhausted))
	groups, err := c.q.HalfByGroup(ctx, c.db, maxGroupSeries)
	if err != nil {
		return r, fmt.Errorf("count half messages by group: %w", err)
	}
	c.m.setGroups(groups)

	s := &c.stale
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case r.StaleReady > 0 && s.stale == 0:
		c.log.Warn("ready rows are waiting longer than they should: is the relay running, are their subjects publishable, or does a dead row of their key hold them back (`"+
			cmdline.Command(c.cfg.Schema, "relay dead list")+"`)? Logged again once they are all published; txoutbox_checkback_stale_ready_rows follows them",
			"stale_ready_rows", r.StaleReady, "older_than", c.cfg.StaleReadyAfter.String(),
			"oldest_ready_age", r.OldestReady.Round(time.Second).String())
	case r.StaleReady == 0 && s.stale > 0:
		c.log.Info("no stale ready rows any more", "oldest_ready_age", r.OldestReady.Round(time.Millisecond).String())
	}
	s.stale = r.StaleReady
	if r.Exhausted != s.exhausted {
		if r.Exhausted > 0 {
			c.log.Warn("half messages await an operator in state check_exhausted: `"+cmdline.Command(c.cfg.Schema, "relay prepared list --state check_exhausted")+"`",
				"check_exhausted", r.Exhausted)
		} else {
			c.log.Info("no check_exhausted half messages any more")
		}
		s.exhausted = r.Exhausted
	}
	return r, nil
}
