package relay

import (
	"context"
	"errors"
	"time"

	"github.com/txoutbox/txoutbox/internal/jserr"
)

// streamCheckTimeout bounds one pass of the start check: a JetStream that does not answer
// within it is waited for, and asked again. It is the publish timeout (how long JetStream may
// take to answer), kept within [2s, 10s].
func (r *Relay) streamCheckTimeout() time.Duration {
	return min(max(r.cfg.PublishTimeout, 2*time.Second), 10*time.Second)
}

// checkStreamsWaiting runs CheckStreams until it gets an answer. While JetStream or a stream
// cannot answer (streamCheckWaitable: timeouts, no responders, a cluster or a stream electing
// a leader) it waits, logging one warning with the error and one info line once the check
// passes; an answer that says the configuration is wrong (a missing stream, a short
// duplicate window, an unusable stream, a refused request, a JetStream API request the
// server denied the relay's NATS user: ErrPublishDenied) ends it with that error. It
// returns ctx's error when ctx ends while it waits. While it waits, Health says what for
// (startWaitHealth); whatever ends the wait leaves it at HealthStarting again.
func (r *Relay) checkStreamsWaiting(ctx context.Context) error {
	waited := false
	defer func() {
		if waited {
			r.setStartHealth(healthStarting)
		}
	}()
	for pass := 1; ; pass++ {
		began := time.Now()
		cctx, cancel := context.WithTimeout(ctx, r.streamCheckTimeout())
		err := r.CheckStreams(cctx)
		cancel()
		if err != nil && streamCheckWaitable(err) {
			// A request the server refused looks like one unanswered (the refusal reaches
			// the connection's error handler only): no wait fixes that.
			if derr := r.denied.deniedAPI(began); derr != nil {
				err = derr
			}
		}
		switch {
		case err == nil:
			if waited {
				r.log.Info("streams checked: JetStream answers")
			}
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		case !streamCheckWaitable(err):
			return err
		case !waited:
			waited = true
			r.setStartHealth(startWaitHealth(err))
			var pe *postgresUnavailableError
			if errors.As(err, &pe) {
				r.log.Warn("waiting for PostgreSQL to answer the start-up stream check", "err", err,
					"why", "PostgreSQL starting or out of reach; checked again until it answers")
			} else {
				r.log.Warn("waiting for JetStream to answer the start-up stream check", "err", err,
					"why", "a stream or the cluster electing a leader, JetStream starting or out of reach; checked again until it answers")
			}
		default:
			r.setStartHealth(startWaitHealth(err))
			r.log.Debug("still waiting for JetStream to answer the start-up stream check", "err", err)
		}
		t := time.NewTimer(r.streamCheckDelay(pass))
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// startWaitHealth is the health of a relay waiting at its start-up stream check after err (a
// waitable one): what it waits for, which /readyz and the health gauge show, not "starting".
func startWaitHealth(err error) healthState {
	var pe *postgresUnavailableError
	if errors.As(err, &pe) {
		return healthPostgresDown
	}
	return healthNATSDown
}

// setStartHealth sets the relay's health while it waits at its start-up stream check, without
// the log line of setHealth: the wait logs its own.
func (r *Relay) setStartHealth(h healthState) {
	if healthState(r.health.Swap(int32(h))) != h {
		r.m.setHealth(h)
	}
}

// streamCheckDelay is the wait after the pass-th failed start-up check: 100ms doubling up to
// 2s, with the relay's BackoffJitter (the one backoff every component uses).
func (r *Relay) streamCheckDelay(pass int) time.Duration {
	return backoff(pass, 100*time.Millisecond, 2*time.Second, r.cfg.BackoffJitter)
}

// streamCheckWaitable reports whether a failed stream check may pass by waiting: JetStream
// or a stream did not answer (a timeout; no responders, which the client reports as
// "JetStream not enabled"; the connection reconnecting), or answered that it cannot answer
// now (outageCodes: 10008 "JetStream system temporarily unavailable", not the leader, stream
// offline). Every other answer is final: a *StreamError, or any other JetStream API error
// (not authorised, JetStream not enabled for the account, an invalid stream configuration).
// Error types and codes are read, never messages.
func streamCheckWaitable(err error) bool {
	var se *StreamError
	if errors.As(err, &se) {
		return false
	}
	var pe *postgresUnavailableError
	if errors.As(err, &pe) {
		return true
	}
	return jserr.Waitable(err)
}

// postgresUnavailableError is the start-up check's read of the SQL producers' message limit
// (producersLimit) failing for want of an answer from PostgreSQL: waited for, like JetStream.
type postgresUnavailableError struct{ err error }

func (e *postgresUnavailableError) Error() string {
	return "PostgreSQL did not answer the read of the SQL producers' message limit: " + e.err.Error()
}
func (e *postgresUnavailableError) Unwrap() error { return e.err }
