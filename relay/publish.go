package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/outbox"
	"go.opentelemetry.io/otel/trace"
)

// batchResult is what publishing a batch produced.
type batchResult struct {
	published []store.Published
	failed    []store.Failed
	// brokerErr is the first broker-level error; rows it hit, and the later rows of their
	// keys, are left untouched.
	brokerErr error
	// streamErr is the first errStreamUnavailable: rows of a stream without a leader, and
	// the later rows of their keys, are left untouched; the other rows go on.
	streamErr error
	// heldKeys maps the keys with a row that was not published (failed, left to a stream
	// outage, or never sent because an earlier row of the key was not published) to the
	// lowest such row id: the next batch must not publish their rows after it. Rows before it
	// (rows of an earlier batch claimed again, such as one left to a stream outage) may go:
	// every row of the key before the held one was published.
	heldKeys map[string]int64
	// permanent lists the message ids of the failed rows that become dead at once.
	permanent []uuid.UUID
	// withheld counts the rows not sent because the relay's lease had ended (see
	// leaser.valid); they are left untouched, like the rows a broker error hit.
	withheld int
}

type outcome struct {
	ack *jetstream.PubAck
	err error
}

// publish publishes rows (in id order) in waves: the first wave holds every unkeyed row and
// the first row of each key; each following wave holds the next row of every key whose
// previous row was acknowledged. A key whose row failed sends nothing more in this batch, and
// the claim query holds its later rows back until the failed one is published. Within a wave
// all publishes are pipelined. Rows of the held keys after their held row are not sent at all.
// Each row is sent only while the lease the batch was claimed under (generation gen) is still
// valid: once it is not, nothing more of the batch is sent and the rest is left as it is.
func (r *Relay) publish(ctx context.Context, rows []store.Claimed, held map[string]int64, gen uint64) *batchResult {
	res := &batchResult{heldKeys: map[string]int64{}}
	hold := func(k string, id int64) {
		if from, ok := res.heldKeys[k]; !ok || id < from {
			res.heldKeys[k] = id
		}
	}
	chains := map[string][]int{}
	var wave []int
	for i := range rows {
		k := rows[i].Key
		if k == "" {
			wave = append(wave, i)
			continue
		}
		if from, ok := held[k]; ok && rows[i].ID > from {
			hold(k, rows[i].ID)
			continue
		}
		if len(chains[k]) == 0 {
			wave = append(wave, i)
		}
		chains[k] = append(chains[k], i)
	}
	eligible := len(wave) // rows this batch may send: the unkeyed, and the chains of keys not held
	for _, chain := range chains {
		eligible += len(chain) - 1
	}
	brokerHit, streamHit := 0, 0
	pos := map[string]int{}
	streamNames := map[string]string{} // subject → the stream capturing it, for describePermanent
	for n := 1; len(wave) > 0; n++ {
		if h := r.hooks.beforeWave; h != nil {
			h(n)
		}
		outs := r.publishWave(ctx, rows, wave, gen)
		if h := r.hooks.afterWave; h != nil {
			h(n, outs)
		}
		r.explainFailures(ctx, rows, wave, outs)
		var next []int
		// With an outage on (explainFailures may have begun one), or failures counted against
		// a stream's leader (leaderStrikes): the subjects of the wave's acknowledged
		// publishes, and the streams of its publishes that met an outage.
		anyOutage := r.outages.n.Load() > 0 || r.strikes.n.Load() > 0
		var acked []string
		down := map[string]bool{}
		for j, i := range wave {
			row, o := &rows[i], outs[j]
			switch {
			case errors.Is(o.err, errLeaseEnded):
				res.withheld++
			case o.err == nil:
				res.published = append(res.published, store.Published{ID: row.ID, Stream: o.ack.Stream, Seq: o.ack.Sequence})
				r.windows.note(o.ack.Stream)
				if o.ack.Duplicate {
					r.stats.Duplicates.Add(1)
					r.m.duplicates.Inc()
				}
				r.m.latency.Observe(time.Since(row.ReadyAt).Seconds())
				r.observeLateness(row)
				r.failing.succeeded(r.log, row.Subject)
				if anyOutage && (len(acked) == 0 || acked[len(acked)-1] != row.Subject) {
					acked = append(acked, row.Subject)
				}
				if row.Key != "" {
					pos[row.Key]++
					if p := pos[row.Key]; p < len(chains[row.Key]) {
						next = append(next, chains[row.Key][p])
					}
				}
			case isBrokerError(o.err):
				brokerHit++
				if res.brokerErr == nil {
					res.brokerErr = o.err
				}
				r.m.failures.WithLabelValues("broker").Inc()
			case errors.Is(o.err, errStreamUnavailable):
				// An outage of the row's stream: the row is left as it is (no attempt), its
				// key is held, the other rows of the batch go on.
				streamHit++
				if res.streamErr == nil {
					res.streamErr = o.err
				}
				var se *streamOutageError
				if errors.As(o.err, &se) {
					r.outages.hold(se.stream, row.ID, row.Key, gen)
					if se.sent {
						down[se.stream] = true
					}
				}
			default:
				perm := isPermanent(o.err)
				text := describe(row, o.err)
				if perm {
					text = r.describePermanent(ctx, row, o.err, streamNames)
					res.permanent = append(res.permanent, row.MessageID)
				}
				text = lastError(text)
				res.failed = append(res.failed, store.Failed{
					ID:        row.ID,
					Err:       text,
					Delay:     backoff(int(row.Attempts)+1, r.cfg.BackoffBase, r.cfg.BackoffMax, r.cfg.BackoffJitter),
					Permanent: perm,
				})
				r.m.failures.WithLabelValues("message").Inc()
				r.failing.failed(r.log, row, text, !perm && row.Attempts+1 < int32(r.cfg.MaxAttempts))
			}
		}
		// An acknowledged publish ends its stream's outage, unless a publish of the same wave
		// met that outage: a wave in flight when the leader went has PubAcks from before and
		// failures from after, and its outage is not over (the wave's order of outcomes says
		// nothing about the order in time). Rows not sent for an outage already known do not
		// count: the stream may have answered with a leader since.
		r.outages.succeededExcept(r, acked, down)
		r.strikes.acked(acked)
		if res.brokerErr != nil || res.withheld > 0 {
			// The broker is gone, or the lease ended: send nothing more; the rows stay ready.
			break
		}
		wave = next
	}
	if res.withheld > 0 {
		// Count every row of the batch left unsent for the lease, not only the wave's.
		res.withheld = eligible - len(res.published) - len(res.failed) - brokerHit - streamHit
		r.stats.Withheld.Add(int64(res.withheld))
		r.m.changes.WithLabelValues("expired").Inc()
		r.log.Warn("this relay's partition lease ended before it could publish its whole batch (a pause, or partitions released or lost): "+
			"the rest is left to the relay that holds the partitions now", "withheld", res.withheld, "published", len(res.published))
	}
	// Every key with a row left unpublished holds back its later rows in the next batch.
	for k, chain := range chains {
		if pos[k] < len(chain) {
			hold(k, rows[chain[pos[k]]].ID)
		}
	}
	return res
}

// LastErrorMaxBytes bounds the error text the relay stores in a failed row's last_error (and
// logs): longer texts are cut on a character boundary and end with "…". Texts from JetStream
// are made storable first: invalid UTF-8 and NUL bytes become U+FFFD.
const LastErrorMaxBytes = 1024

// lastError makes s storable in last_error.
func lastError(s string) string { return store.ErrorText(s) }

func describe(row *store.Claimed, err error) string {
	if isNoResponders(err) {
		return fmt.Sprintf("no JetStream stream captures subject %q (%v)", row.Subject, err)
	}
	return err.Error()
}

// permanentCodes are the JetStream API errors of a PubAck that say this message can never be
// stored as it is: retrying cannot help, so its row becomes dead at once (an operator can
// requeue it once the stream, or the message, is fixed). Errors about the stream's state
// (full under discard-new, insufficient resources, no leader) are not here: they pass.
var permanentCodes = map[jetstream.ErrorCode]string{
	10054: "the message is larger than the stream's max_msg_size (or the server's max_payload)",
	10097: "the message's headers exceed JetStream's 64 KiB limit",
	10109: "the stream is sealed",
	10060: "the message's Nats-Expected-Stream header names another stream",
	10165: "the message's Nats-TTL header is invalid",
	10166: "the message has a Nats-TTL header, and the stream does not allow per-message TTLs (allow_msg_ttl)",
	10168: "the message has a Nats-Incr header, and the stream is not a counter stream",
	10169: "the stream is a counter stream (allow_msg_counter) and the message has no Nats-Incr header",
	10170: "the message has a Nats-Incr header and a payload",
	10171: "the message's Nats-Incr header is invalid",
	10188: "the message is scheduled, and the stream does not allow schedules (allow_msg_schedules)",
	10227: "the message has a Nats-Stream-Source header, which publishers may not set",
}

// isPermanent reports errors that retrying cannot help with.
func isPermanent(err error) bool {
	var se *StreamError
	if errors.Is(err, errBadHeaders) || errors.As(err, &se) && se.Setting == "sealed" {
		return true
	}
	// nats.go refuses, before sending, a message over the server's max_payload: no retry of
	// the same row can be smaller.
	if errors.Is(err, nats.ErrMaxPayload) {
		return true
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		_, ok := permanentCodes[apiErr.ErrorCode]
		return ok
	}
	return false
}

// describePermanent says why a message can never be published as it is, naming the stream
// that refused it when JetStream says which one (names caches its answers for one batch, by
// subject).
func (r *Relay) describePermanent(ctx context.Context, row *store.Claimed, err error, names map[string]string) string {
	var se *StreamError
	if errors.As(err, &se) {
		return "can never be published as it is, dead at once (retrying cannot help): " + err.Error()
	}
	why := "the stored row would not arrive as it is stored"
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		why = permanentCodes[apiErr.ErrorCode]
	} else if errors.Is(err, nats.ErrMaxPayload) {
		why = fmt.Sprintf("the message (payload %d bytes, plus its headers) is larger than the server's max_payload (%d bytes); "+
			"set the producers' outbox.Config.MaxMessageBytes to at most max_payload, or raise max_payload", len(row.Payload), r.js.Conn().MaxPayload())
	}
	where := fmt.Sprintf("subject %q", row.Subject)
	if apiErr != nil {
		name, ok := names[row.Subject]
		if !ok {
			lctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
			name, _ = r.pub.StreamNameBySubject(lctx, row.Subject)
			cancel()
			names[row.Subject] = name
		}
		if name != "" {
			where = fmt.Sprintf("stream %q (capturing %q)", name, row.Subject)
		}
	}
	return fmt.Sprintf("can never be published as it is, dead at once (retrying cannot help): %s: %s (%v)", where, why, err)
}

func isNoResponders(err error) bool {
	return errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders)
}

// isBrokerError reports errors about the connection or the broker rather than the message.
// They include the errors of the socket write nats.go makes inside a publish when its buffer
// is full (a connection reset, a write deadline, the write fence's ErrStaleWrite, the closed
// connection after it): never an attempt of the row being handed off.
func isBrokerError(err error) bool {
	return connectionLost(err) ||
		errors.Is(err, os.ErrDeadlineExceeded) ||
		errors.Is(err, io.ErrShortWrite) ||
		errors.Is(err, jetstream.ErrAsyncPublishTimeout) ||
		errors.Is(err, nats.ErrTimeout) ||
		errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, context.Canceled) ||
		errors.Is(err, jetstream.ErrTooManyStalledMsgs) ||
		errors.Is(err, jetstream.ErrJetStreamPublisherClosed) ||
		errors.Is(err, jetstream.ErrJetStreamNotEnabled) ||
		errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount) ||
		errors.Is(err, errAckWaitExpired) ||
		errors.Is(err, errJetStreamDown)
}

var errAckWaitExpired = errors.New("relay: no PubAck within the publish timeout")

// probeTimeout bounds a question asked to JetStream about the broker, a subject or a stream.
func (r *Relay) probeTimeout() time.Duration { return min(r.cfg.PublishTimeout, probeBound) }

// probeBound bounds a look at JetStream that explains failed publishes (probeTimeout);
// RequiredDuplicateWindow counts it.
const probeBound = 2 * time.Second

// jetStreamAnswers asks JetStream for account info, to tell "no stream for this subject" from
// "JetStream is not there".
func (r *Relay) jetStreamAnswers(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
	defer cancel()
	_, err := r.pub.AccountInfo(ctx)
	return err == nil
}

// noClientRetry turns off nats.go's own resend of an async publish answered with "no
// responders" (by default two more sends, 250 ms apart, from a timer): those sends would
// skip the relay's lease check, so a relay whose lease ended after the hand-off (a release,
// a pause) could still send the message. The "no responders" comes back as the publish's
// outcome at once instead; explainFailures makes it an outage wave when the stream has no
// leader (an election) or a leader without its quorum, and the row is sent again in a
// later wave, after the lease check (TestNoResendAfterTheLeaseEnded).
var noClientRetry = []jetstream.PublishOpt{jetstream.WithRetryAttempts(0)}

// errLeaseEnded: a row was not sent because the relay's lease had ended.
var errLeaseEnded = errors.New("relay: partition lease ended")

// publishWave publishes the rows at idxs, at most MaxInFlight unacknowledged at a time, and
// returns each one's outcome. Each row is handed to the NATS client only after the lease
// check (leaser.valid), made after any wait for a PubAck slot and again after the stream
// checks, immediately before PublishMsgAsync; once it fails, the rest of the wave is not sent
// (errLeaseEnded). A publish the server reports as a permission violation
// fails as soon as the report arrives (ErrPublishDenied), not after PublishTimeout.
func (r *Relay) publishWave(ctx context.Context, rows []store.Claimed, idxs []int, gen uint64) []outcome {
	start := time.Now() // a permission violation reported after it may be about this wave
	outs := make([]outcome, len(idxs))
	futs := make([]jetstream.PubAckFuture, len(idxs))
	spans := make([]trace.Span, len(idxs)) // publish spans (see trace.go)
	var seqs []uint64                      // the write fence's numbers of the messages handed (see writefence.go)
	if r.fence != nil {
		seqs = make([]uint64, len(idxs))
	}
	var queue []int // positions in idxs with a future not yet awaited
	await := func(j int) {
		f := futs[j]
		if r.fence != nil {
			// A message the server answered has left the client's buffer, and every message
			// handed before it; one without an answer (a PubAck timeout: a pause?) may still
			// be in it, and the write fence keeps watching the lease it was handed under.
			defer func() {
				if serverAnswered(outs[j].err) {
					r.fence.answered(seqs[j])
				}
			}()
		}
		select { // most PubAcks are in by the time they are awaited: no timer for those
		case ack := <-f.Ok():
			outs[j].ack = ack
			endPublish(spans[j], outs[j])
			return
		case err := <-f.Err():
			outs[j].err = err
			endPublish(spans[j], outs[j])
			return
		default:
		}
		t := time.NewTimer(r.cfg.PublishTimeout + time.Second)
		defer t.Stop()
	wait:
		for {
			// A publish the server denied never gets a PubAck: fail it once the server says so.
			denied := r.denied.changed()
			if err := r.denied.check(rows[idxs[j]].Subject, start); err != nil {
				outs[j].err = err
				break
			}
			select {
			case ack := <-f.Ok():
				outs[j].ack = ack
				break wait
			case err := <-f.Err():
				outs[j].err = err
				break wait
			case <-t.C:
				// The library's own timeout should have fired; never wait forever.
				outs[j].err = errAckWaitExpired
				break wait
			case <-denied:
			}
		}
		endPublish(spans[j], outs[j])
	}
	failRest, ended := false, false
	for j, i := range idxs {
		if failRest {
			outs[j].err = nats.ErrConnectionClosed
			continue
		}
		for len(queue) >= r.cfg.MaxInFlight {
			await(queue[0])
			queue = queue[1:]
		}
		if ended = ended || !r.lease.valid(gen); ended {
			outs[j].err = errLeaseEnded
			continue
		}
		if h := r.hooks.afterLeaseCheck; h != nil {
			h()
		}
		if err := r.knownOutage(ctx, rows[i].Subject); err != nil {
			outs[j].err = err // not sent: its stream has no leader (see explainFailures)
			continue
		}
		if err := r.knownUnusable(ctx, rows[i].Subject); err != nil {
			outs[j].err = err // not sent: its stream cannot take it (see explainFailures)
			continue
		}
		if err := r.denied.recent(rows[i].Subject); err != nil {
			outs[j].err = err // not sent: the server just denied its subject (see denied.go)
			continue
		}
		msg, err := buildMsg(&rows[i])
		if err != nil {
			outs[j].err = err
			continue
		}
		// Again, immediately before the hand-off: the stream checks above may have asked
		// JetStream (up to outageAsk, or probeTimeout). A local check, no I/O.
		if !r.lease.valid(gen) {
			ended = true
			outs[j].err = errLeaseEnded
			continue
		}
		spans[j] = r.trace.startPublish(ctx, &rows[i], msg)
		if r.fence != nil {
			seqs[j] = r.fence.handing(gen)
		}
		f, err := r.pub.PublishMsgAsync(msg, noClientRetry...)
		if r.fence != nil {
			if err != nil {
				r.fence.handFailed(seqs[j]) // its bytes are not in the client's buffer
			} else {
				r.fence.handedOff()
			}
		}
		if err != nil {
			outs[j].err = err
			endPublish(spans[j], outs[j])
			if isBrokerError(err) {
				failRest = true
			}
			continue
		}
		futs[j] = f
		queue = append(queue, j)
	}
	for _, j := range queue {
		await(j)
	}
	if r.denied.n.Load() > 0 {
		// A timeout whose violation came in before it was awaited.
		for j, i := range idxs {
			if isAckTimeout(outs[j].err) {
				if err := r.denied.check(rows[i].Subject, start); err != nil {
					outs[j].err = err
				}
			}
		}
	}
	return outs
}

// errBadHeaders marks a stored row that cannot be published as it is: headers that are not a
// JSON object of string lists, or a subject, key, header name or value the producer would
// have refused (a row written before the producer's rules, or not by package outbox): a
// subject that is not a literal publish subject or that addresses NATS itself ($JS.API.…, a
// request the relay would make with its credentials), a key or header that would not reach
// the consumer exactly as stored. The relay never sends such a row and never lets the wire
// alter a message: it is dead at once, with the reason.
var errBadHeaders = errors.New("relay: stored row cannot be published as it is")

func buildMsg(row *store.Claimed) (*nats.Msg, error) {
	var h nats.Header
	if len(row.Headers) > 0 {
		if err := json.Unmarshal(row.Headers, (*map[string][]string)(&h)); err != nil {
			return nil, fmt.Errorf("%w: the stored headers are not a JSON object of string lists: %v", errBadHeaders, err)
		}
	}
	if err := checkStored(row.Subject, row.Key, h); err != nil {
		return nil, fmt.Errorf("%w: %v", errBadHeaders, err)
	}
	if h == nil {
		h = make(nats.Header, 2)
	}
	// h.Set's, with one allocation for both values.
	vals := [2]string{row.MessageID.String(), row.Key}
	h[outbox.HeaderMsgID] = vals[0:1:1]
	if row.Key != "" {
		h[outbox.HeaderKey] = vals[1:2:2]
	}
	return &nats.Msg{Subject: row.Subject, Header: h, Data: row.Payload}, nil
}

// checkStored applies the producer's rules (package outbox) to a stored subject, key and
// headers, so that what the relay publishes is a message, never a request to the server, and
// arrives exactly as stored.
func checkStored(subject, key string, h nats.Header) error {
	if err := outbox.ValidateSubject(subject); err != nil {
		return err
	}
	if err := outbox.ValidateKey(key); err != nil {
		return err
	}
	for name, values := range h {
		if name == outbox.HeaderBizKey { // stored with the headers by the producer
			if len(values) != 1 {
				return fmt.Errorf("%w: %s has %d values", outbox.ErrInvalidKey, name, len(values))
			}
			if err := outbox.ValidateKey(values[0]); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			continue
		}
		if err := outbox.ValidateHeaderName(name); err != nil {
			return err
		}
		if len(values) == 0 {
			return fmt.Errorf("%w: %q has no value", outbox.ErrInvalidHeader, name)
		}
		for _, v := range values {
			if err := outbox.ValidateHeaderValue(v); err != nil {
				return fmt.Errorf("%q: %w", name, err)
			}
		}
	}
	return nil
}
