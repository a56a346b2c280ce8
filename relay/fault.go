package relay

import (
	"context"
	"time"
)

// FaultInjection are fault-injection points for crash tests of the relay (the relay binary
// exposes them as hidden flags). Never set them in production.
type FaultInjection struct {
	// SettleDelay pauses every batch after all its PubAcks are in and before it is settled,
	// after logging "fault injection: pausing before settle" at debug level, so that a test
	// can kill the relay exactly between publish and settle.
	SettleDelay time.Duration
}

// InjectFaults installs f. Call it before Run.
func (r *Relay) InjectFaults(f FaultInjection) {
	if f.SettleDelay <= 0 {
		r.hooks.afterPublish = nil
		return
	}
	r.hooks.afterPublish = func(ctx context.Context, published int) error {
		r.log.Debug("fault injection: pausing before settle", "published", published, "delay", f.SettleDelay.String())
		time.Sleep(f.SettleDelay)
		return nil
	}
}
