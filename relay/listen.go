package relay

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// listen wakes the relay on Postgres notifications on Config.DoorbellChannel, reconnecting
// with backoff; notifications only shorten the wait, so a lost one costs a poll interval.
func (r *Relay) listen(ctx context.Context) {
	fails := 0
	for ctx.Err() == nil {
		err := r.listenOnce(ctx, func() {
			if fails > 0 {
				r.log.Info("doorbell listener back", "channel", r.cfg.DoorbellChannel)
			}
			fails = 0
		})
		if ctx.Err() != nil {
			return
		}
		fails++
		if fails == 1 {
			r.log.Warn("doorbell listener lost; reconnecting", "channel", r.cfg.DoorbellChannel, "err", err)
		}
		t := time.NewTimer(backoff(fails, 100*time.Millisecond, r.cfg.BackoffMax, r.cfg.BackoffJitter))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// listenOnce listens on one connection until it fails; listening runs once LISTEN succeeded.
func (r *Relay) listenOnce(ctx context.Context, listening func()) error {
	pc, err := r.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	conn := pc.Hijack() // a listening connection must not go back to the pool
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{r.cfg.DoorbellChannel}.Sanitize()); err != nil {
		return err
	}
	listening()
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		r.Wake()
	}
}
