package relay

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/txoutbox/txoutbox"
)

// ErrClosed is returned by Run once Close was called: a closed relay has released its
// lease connection and stopped watching its NATS connection, and does not run again.
var ErrClosed = errors.New("relay: closed")

// runControl ties Run, Close and the background work of a run together: Close stops a
// running Run and waits for it, and Run waits for the background asks it started (see
// goBackground) before it returns.
type runControl struct {
	mu     sync.Mutex
	cancel context.CancelFunc // ends the running Run's context; nil while none runs
	done   chan struct{}      // closed when that Run has returned
	closed bool
	ending bool // the running Run is returning: no more background asks

	bg      sync.WaitGroup
	bgStops map[*int]context.CancelFunc // of the background asks under way

	// waitingForRun, when set (by tests), runs when close has stopped a running Run and is
	// about to wait for it.
	waitingForRun func()
}

// start marks a Run as running and returns its context (ended by Close too) and the
// function Run defers, which ends the background asks, waits for them and marks the relay
// as not running.
func (c *runControl) start(ctx context.Context) (context.Context, func(), error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, nil, ErrClosed
	}
	if c.done != nil {
		return nil, nil, txoutbox.ErrRunning
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	c.cancel, c.done = cancel, done
	return ctx, func() {
		cancel()
		c.mu.Lock()
		c.ending = true
		for _, stop := range c.bgStops {
			stop()
		}
		c.mu.Unlock()
		c.bg.Wait()
		c.mu.Lock()
		c.cancel, c.done, c.ending = nil, nil, false
		c.mu.Unlock()
		close(done)
	}, nil
}

// goBackground runs f in a goroutine with a context of at most timeout that also ends when
// the running Run returns, which waits for f. Without a running Run (runOnce in tests) f
// runs before goBackground returns; once the running Run is returning, f runs at once with
// an ended context.
func (c *runControl) goBackground(timeout time.Duration, f func(ctx context.Context)) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	c.mu.Lock()
	if c.done == nil || c.ending {
		if c.ending {
			cancel()
		}
		c.mu.Unlock()
		defer cancel()
		f(ctx)
		return
	}
	key := new(int)
	if c.bgStops == nil {
		c.bgStops = map[*int]context.CancelFunc{}
	}
	c.bgStops[key] = cancel
	c.bg.Add(1)
	c.mu.Unlock()
	go func() {
		defer c.bg.Done()
		defer func() {
			c.mu.Lock()
			delete(c.bgStops, key)
			c.mu.Unlock()
			cancel()
		}()
		f(ctx)
	}()
}

// close marks the relay closed, stops a running Run and waits for it to return.
func (c *runControl) close() {
	c.mu.Lock()
	c.closed = true
	cancel, done := c.cancel, c.done
	waiting := c.waitingForRun
	c.mu.Unlock()
	if cancel != nil {
		cancel()
		if waiting != nil {
			waiting()
		}
		<-done
	}
}
