package consumer

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"
)

// item is a message the consumer holds, from its delivery until it is acked, nak'ed or
// terminated.
type item struct {
	raw jetstream.Msg
	msg Message
	bad error // why the message is malformed, or nil

	deliveries int    // JetStream's delivery count
	retries    int    // in-place handler retries (ordered mode)
	outages    int    // consecutive Postgres/NATS failures, not counted as attempts
	orderKey   string // the key it is ordered by, in ordered mode
	managed    bool   // held by a dispatcher, which can retry it in place
	waits      int    // consecutive checks that found an earlier message of its key unsettled
	slot       bool   // it holds a slot of dispatcher.sem; dispatcher.mu

	touched time.Time // last in-progress ack (zero: none yet); dispatcher.mu

	span trace.Span // its process span while a worker handles it (see trace.go), or nil

	ackMu   sync.Mutex // orders in-progress acks before the final ack, nak or term
	settled bool       // a final ack, nak or term was sent; ackMu
}

// final sends the message's final acknowledgement (ack, nak or term) through send, after which
// no in-progress ack is sent for it: a late one would reset the server's redelivery timer and
// cut a NakWithDelay backoff short. An in-progress ack already being sent goes out first.
func (it *item) final(send func() error) error {
	it.ackMu.Lock()
	it.settled = true
	it.ackMu.Unlock()
	return send()
}

// inProgress tells JetStream the message is still being worked on, unless it was settled.
func (it *item) inProgress() {
	it.ackMu.Lock()
	defer it.ackMu.Unlock()
	if !it.settled {
		_ = it.raw.InProgress()
	}
}

func newItem(raw jetstream.Msg, ordered bool) *item {
	it := &item{raw: raw}
	it.msg, it.bad = decode(raw)
	it.deliveries = max(it.msg.Delivery, 1)
	if ordered && it.bad == nil && it.msg.Key != "" {
		if err := validOrderKey(it.msg.Key); err != nil {
			it.bad = err // it could not be recorded in the key-order table
		} else {
			it.orderKey = it.msg.Key
		}
	}
	return it
}

// attempt is the 1-based attempt number of the run about to happen (or that just failed).
func (it *item) attempt() int { return it.deliveries + it.retries }

// dispatcher hands held messages to the workers: in batches of up to BatchSize, and, in
// ordered mode, at most one message per key at a time, in stream order.
//
// A message holds a slot of sem from its admission until it is released, except in ordered
// mode while its key waits for an earlier message this instance does not hold (a parked key):
// the key's messages then give their slots back, so that the earlier message, redelivered to
// this instance, can be taken in. The messages held stay bounded by the durable's
// MaxAckPending.
type dispatcher struct {
	c     *Consumer
	sem   chan struct{} // one slot per held message, parked keys' messages aside
	ready chan *item    // sends never block while d.mu is held (see send)
	stop  chan struct{} // closed by quit: workers return
	done  chan struct{} // closed by shutdown, once the workers returned: keepalive returns

	mu      sync.Mutex
	held    map[*item]struct{}
	waiting map[string][]*item       // busy keys and their queued messages, by stream sequence (ordered mode)
	parked  map[string]*parkedKey    // busy keys whose running message waits for an earlier one
	timers  map[*time.Timer]struct{} // pending in-place retries and parked keys; shutdown stops them
	closed  bool
	quitted bool
}

func newDispatcher(c *Consumer) *dispatcher {
	n := c.cfg.Concurrency*c.cfg.BatchSize + c.cfg.PullMaxMessages
	return &dispatcher{
		c:       c,
		sem:     make(chan struct{}, n),
		ready:   make(chan *item, n),
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
		held:    make(map[*item]struct{}, n),
		waiting: make(map[string][]*item),
		parked:  make(map[string]*parkedKey),
		timers:  make(map[*time.Timer]struct{}),
	}
}

// admit takes a delivered message (JetStream's callback; it blocks while the consumer holds
// as many messages as it may, which pauses pulling).
func (d *dispatcher) admit(raw jetstream.Msg, stopping <-chan struct{}) {
	d.c.natsUp()
	select {
	case <-stopping:
		_ = raw.Nak()
		return
	default:
	}
	select {
	case d.sem <- struct{}{}:
	case <-stopping:
		_ = raw.Nak()
		return
	}
	it := newItem(raw, d.c.cfg.Ordered)
	it.managed, it.slot = true, true
	if o := d.c.order; o != nil {
		if md, err := raw.Metadata(); err == nil {
			o.observe(md, it.orderKey)
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		<-d.sem
		_ = raw.Nak()
		return
	}
	// touched stays zero: the next keepalive tick sends an in-progress ack if the message is
	// still held then. Its AckWait started when JetStream delivered it, which may be long
	// before this admission (it waited in the client's buffer while the consumer was full).
	d.held[it] = struct{}{}
	if h := d.c.hooks.admitted; h != nil {
		h(it.msg)
	}
	if k := it.orderKey; k != "" {
		if q, busy := d.waiting[k]; busy {
			p := d.parked[k]
			if p == nil {
				d.waiting[k] = insertBySeq(q, it)
				return
			}
			d.freeSlot(it)
			if it.msg.StreamSeq < p.it.msg.StreamSeq && p.t.Stop() {
				// The earlier message the key waits for, or one before it: it runs now.
				delete(d.timers, p.t)
				delete(d.parked, k)
				d.waiting[k] = insertBySeq(q, p.it)
				d.send(it)
				return
			}
			d.waiting[k] = insertBySeq(q, it)
			return
		}
		d.waiting[k] = nil
	}
	d.send(it)
}

// parkedKey is a key whose running message waits for an earlier message of the key.
type parkedKey struct {
	it *item       // the message, checked again when t fires
	t  *time.Timer // its next check
}

// send hands it to the workers; d.mu held. ready is large enough for every message holding a
// slot, but parked keys' messages hold none: when it is full, a goroutine waits to send.
func (d *dispatcher) send(it *item) {
	select {
	case d.ready <- it:
	default:
		go func() {
			select {
			case d.ready <- it:
			case <-d.stop: // still held: shutdown naks it
			}
		}()
	}
}

// freeSlot gives it's slot back; d.mu held.
func (d *dispatcher) freeSlot(it *item) {
	if it.slot {
		it.slot = false
		<-d.sem
	}
}

// insertBySeq inserts it into q, kept in stream order.
func insertBySeq(q []*item, it *item) []*item {
	i := len(q)
	for i > 0 && q[i-1].msg.StreamSeq > it.msg.StreamSeq {
		i--
	}
	return slices.Insert(q, i, it)
}

// take returns the next batch, or nil once the dispatcher quits.
func (d *dispatcher) take() []*item {
	select {
	case <-d.stop:
		return nil
	default:
	}
	var first *item
	select {
	case first = <-d.ready:
	case <-d.stop:
		return nil
	}
	batch := []*item{first}
	size := d.c.cfg.BatchSize
	for len(batch) < size {
		select {
		case it := <-d.ready:
			batch = append(batch, it)
			continue
		default:
		}
		break
	}
	if len(batch) < size && d.c.cfg.BatchWait > 0 {
		t := time.NewTimer(d.c.cfg.BatchWait)
		defer t.Stop()
	wait:
		for len(batch) < size {
			select {
			case it := <-d.ready:
				batch = append(batch, it)
			case <-t.C:
				break wait
			case <-d.stop:
				break wait
			}
		}
	}
	return batch
}

// work is one worker: it handles batches until the dispatcher quits. A batch taken as it
// quits is not started: its messages stay held, and shutdown naks them.
func (d *dispatcher) work(ctx context.Context) {
	defer d.c.testSignals.workerReturned.Signal(struct{}{})
	for {
		batch := d.take()
		if batch == nil || d.quitting() {
			return
		}
		var results []result
		bctx, span := d.c.startSpans(ctx, batch)
		switch {
		case d.c.cfg.BatchSize == 1:
			results = []result{d.c.handle(bctx, batch[0])}
		case d.c.order != nil:
			results = d.c.handleOrderedBatch(bctx, batch)
		default:
			results = d.c.handleBatch(bctx, batch)
		}
		d.c.endSpans(span, batch, results)
		for i, it := range batch {
			d.settle(it, results[i])
		}
	}
}

// settle releases a finished message, or schedules its in-place retry.
func (d *dispatcher) settle(it *item, r result) {
	switch r.outcome {
	case outcomeWaiting:
		d.park(it, r.delay)
	case outcomeStopped:
		// Run is stopping: another instance may take it at once.
		_ = it.final(it.raw.Nak)
		d.release(it)
	case outcomeRetryLocal, outcomeUnavailable:
		d.mu.Lock()
		defer d.mu.Unlock()
		if d.closed {
			return // shutdown nak'ed it
		}
		var t *time.Timer
		t = time.AfterFunc(r.delay, func() {
			d.mu.Lock()
			defer d.mu.Unlock()
			delete(d.timers, t) // t is set: settle held d.mu until it was
			if !d.closed {
				d.send(it)
			}
		})
		d.timers[t] = struct{}{}
	default:
		d.release(it)
	}
}

// release forgets a message that was acked, nak'ed or terminated, and hands the next message
// of its key to the workers.
func (d *dispatcher) release(it *item) {
	d.mu.Lock()
	if _, ok := d.held[it]; ok {
		delete(d.held, it)
		if k := it.orderKey; k != "" && !d.closed {
			if q := d.waiting[k]; len(q) > 0 {
				d.waiting[k] = q[1:]
				d.send(q[0])
			} else {
				delete(d.waiting, k)
			}
		}
		d.freeSlot(it)
	}
	d.mu.Unlock()
}

// park handles a message whose key waits for an earlier message: an earlier one queued here
// runs first; otherwise the key's messages give their slots back and it is checked again
// after delay (or as soon as an earlier message of the key is admitted).
func (d *dispatcher) park(it *item, delay time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return // shutdown nak'ed it
	}
	k := it.orderKey
	q := d.waiting[k]
	if len(q) > 0 && q[0].msg.StreamSeq < it.msg.StreamSeq {
		d.waiting[k] = insertBySeq(q[1:], it)
		d.send(q[0])
		return
	}
	d.freeSlot(it)
	for _, w := range q {
		d.freeSlot(w)
	}
	p := &parkedKey{it: it}
	p.t = time.AfterFunc(delay, func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		delete(d.timers, p.t) // p.t is set: park held d.mu until it was
		if d.parked[k] == p {
			delete(d.parked, k)
		}
		if !d.closed {
			d.send(it)
		}
	})
	d.parked[k] = p
	d.timers[p.t] = struct{}{}
}

// keepalive sends an in-progress ack for every held message not touched for
// InProgressInterval, so that JetStream does not redeliver messages that are running, waiting
// for their key or waiting for an in-place retry. It runs until shutdown, not just until quit:
// handlers still running during a graceful stop are kept alive until they finish. Each tick,
// every InProgressInterval/2, is one keepaliveOnce.
func (d *dispatcher) keepalive() {
	t := time.NewTicker(max(d.c.cfg.InProgressInterval/2, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-d.done:
			return
		case now := <-t.C:
			d.keepaliveOnce(now)
		}
	}
}

// keepaliveOnce sends an in-progress ack for every held message not touched for
// InProgressInterval at now (except the settled ones), and reports how many were due. It
// signals testSignals.keptAlive with that number when there were any.
func (d *dispatcher) keepaliveOnce(now time.Time) int {
	every := d.c.cfg.InProgressInterval
	var due []*item
	d.mu.Lock()
	for it := range d.held {
		if now.Sub(it.touched) >= every {
			it.touched = now
			due = append(due, it)
		}
	}
	d.mu.Unlock()
	for _, it := range due {
		it.inProgress()
	}
	if len(due) > 0 {
		d.c.testSignals.keptAlive.Signal(len(due))
	}
	return len(due)
}

// quitting reports whether quit was called.
func (d *dispatcher) quitting() bool {
	select {
	case <-d.stop:
		return true
	default:
		return false
	}
}

// quit makes the workers return after their current batch.
func (d *dispatcher) quit() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.quitted {
		d.quitted = true
		close(d.stop)
	}
}

// shutdown naks every message still held (queued, waiting for its key or for a retry) so
// that JetStream redelivers it at once, to another instance if there is one, and stops the
// keepalive and the retry timers. Call it once the workers have returned.
func (d *dispatcher) shutdown() {
	d.quit()
	d.mu.Lock()
	if !d.closed {
		close(d.done)
	}
	d.closed = true
	held := d.held
	d.held = map[*item]struct{}{}
	for t := range d.timers {
		t.Stop() // one already firing finds the dispatcher closed
	}
	clear(d.timers)
	clear(d.parked)
	d.mu.Unlock()
	for it := range held {
		_ = it.final(it.raw.Nak)
	}
}

// handleOrderedBatch is batch mode with the per-key order check: keyed messages are handled
// one per transaction (each checks and records its key's applied sequence), the others as a
// batch.
func (c *Consumer) handleOrderedBatch(ctx context.Context, batch []*item) []result {
	results := make([]result, len(batch))
	var rest []*item
	var restAt []int
	for i, it := range batch {
		if c.guarded(it) {
			results[i] = c.handle(ctx, it)
			continue
		}
		rest, restAt = append(rest, it), append(restAt, i)
	}
	if len(rest) > 0 {
		for j, r := range c.handleBatch(ctx, rest) {
			results[restAt[j]] = r
		}
	}
	return results
}
