package checkback

import (
	"context"
	"fmt"
	"time"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/store"
)

// maxPurgeBatches bounds one purge run per kind; the next run continues.
const maxPurgeBatches = 100

// PurgeResult counts the rows one purge run deleted.
type PurgeResult struct {
	Published  int64
	RolledBack int64
	Dedup      int64
}

// purgeOnce deletes published rows older than PublishedRetention, rolled back rows older than
// RolledBackRetention and consumer dedup rows older than DedupRetention, in batches of
// PurgeBatchSize; a retention of txoutbox.Forever purges nothing of its kind. Each batch is one short statement (its own transaction) that skips locked
// rows, so the purge never holds long locks nor waits on anyone.
func (c *CheckBack) purgeOnce(ctx context.Context) (PurgeResult, error) {
	var r PurgeResult
	kinds := []struct {
		name  string
		n     *int64
		older time.Duration
		del   func(ctx context.Context, older time.Duration, limit int) (int64, error)
	}{
		{store.StatePublished, &r.Published, c.cfg.PublishedRetention, func(ctx context.Context, o time.Duration, l int) (int64, error) {
			return c.q.PurgeMessages(ctx, c.db, store.StatePublished, o, l)
		}},
		{store.StateRolledBack, &r.RolledBack, c.cfg.RolledBackRetention, func(ctx context.Context, o time.Duration, l int) (int64, error) {
			return c.q.PurgeMessages(ctx, c.db, store.StateRolledBack, o, l)
		}},
		{"dedup", &r.Dedup, c.cfg.DedupRetention, func(ctx context.Context, o time.Duration, l int) (int64, error) {
			return c.q.PurgeDedup(ctx, c.db, o, l)
		}},
	}
	for _, k := range kinds {
		if k.older == txoutbox.Forever {
			continue
		}
		for i := 0; i < maxPurgeBatches; i++ {
			n, err := k.del(ctx, k.older, c.cfg.PurgeBatchSize)
			if err != nil {
				return r, fmt.Errorf("purge %s rows: %w", k.name, err)
			}
			*k.n += n
			c.m.purged.WithLabelValues(k.name).Add(float64(n))
			if n < int64(c.cfg.PurgeBatchSize) {
				break
			}
		}
		if *k.n > 0 {
			c.log.Info("purged rows past their retention", "kind", k.name, "rows", *k.n, "retention", k.older.String())
		}
	}
	return r, nil
}
