package checkback

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/cmdline"
	"github.com/txoutbox/txoutbox/internal/safetext"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/tracing"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
	"golang.org/x/time/rate"
)

// ResolveResult is what one resolve pass did.
type ResolveResult struct {
	// Fenced counts fence-mode rows rolled back.
	Fenced int
	// Checks counts checker requests whose outcome was recorded, by outcome.
	Checks map[string]int
	// Committed and RolledBack count rows settled by their checker's answer.
	Committed  int
	RolledBack int
	// Exhausted counts rows that became check_exhausted in this pass.
	Exhausted int
	// Released counts claimed rows given back unchecked (the pass ran out of time).
	Released int
}

// resolveOnce runs one pass: fence-mode rows first (cheap, no network), then checker rows. It
// returns when the pass is complete (tests and `relay checkback --once` call it).
func (c *CheckBack) resolveOnce(ctx context.Context) (ResolveResult, error) {
	return c.resolve(ctx, true)
}

// resolve runs one pass. With wait false (the scheduler's runs) it returns once the checker
// rows are claimed and being asked: a group whose checker is slow keeps working in the
// background, and the next passes fence and check other groups meanwhile instead of waiting.
func (c *CheckBack) resolve(ctx context.Context, wait bool) (ResolveResult, error) {
	res := ResolveResult{Checks: map[string]int{}}
	c.forgetSettledGroups(ctx)
	fenced, ferr := c.fenceOnce(ctx)
	res.Fenced = fenced
	cerr := c.checkOnce(ctx, &res, wait)
	return res, errors.Join(ferr, cerr)
}

// forgetSettledGroups ends the inconclusive state of the groups that have no prepared row a
// check found inconclusive any more (settled by their producer, exhausted, removed), so that
// a later incident of theirs is logged again. A failure is left for the next pass.
func (c *CheckBack) forgetSettledGroups(ctx context.Context) {
	snap := c.inconclusive.snapshot()
	if len(snap) == 0 {
		return
	}
	still, err := c.q.CheckedGroups(ctx, c.db, slices.Collect(maps.Keys(snap)))
	if err != nil {
		if ctx.Err() == nil {
			c.log.Debug("check-back: reading the groups with inconclusive half messages failed; trying at the next pass", "err", err)
		}
		return
	}
	c.inconclusive.settled(c.log, snap, still)
}

// fenceOnce rolls back due fence-mode rows under their row locks, in one short transaction.
// Rows whose CommitTx is in flight are locked by it and skipped (SKIP LOCKED): they are
// committed, or, if their business transaction rolls back, fenced at a later pass. A CommitTx
// that reaches a row while this transaction holds it waits, then finds it rolled back.
func (c *CheckBack) fenceOnce(ctx context.Context) (int, error) {
	tx, err := c.db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("fence: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	ids, err := c.q.LockFences(ctx, tx, c.cfg.transactionTimeout(), c.cfg.BatchSize)
	if err != nil {
		return 0, fmt.Errorf("fence: lock: %w", err)
	}
	if len(ids) == 0 {
		return 0, nil
	}
	if c.hooks.afterFenceLock != nil {
		c.hooks.afterFenceLock(ctx, ids)
	}
	fenced, err := c.q.Fence(ctx, tx, ids)
	if err != nil {
		return 0, fmt.Errorf("fence: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("fence: commit: %w", err)
	}
	for _, id := range fenced {
		c.log.Info("half message fenced: still prepared after the transaction timeout, rolled back; a later CommitTx fails",
			"message_id", id.String(), "transaction_timeout", c.cfg.transactionTimeout().String())
	}
	c.m.resolved.WithLabelValues("fenced").Add(float64(len(fenced)))
	return len(fenced), nil
}

// lease is how long claimed checker rows stay invisible to other passes: long enough for a
// whole batch of one group at its concurrency and rate, plus one request.
func (c *CheckBack) lease() time.Duration {
	waves := math.Ceil(float64(c.cfg.BatchSize) / float64(c.cfg.GroupConcurrency))
	byConc := time.Duration(waves) * c.cfg.RequestTimeout
	var byRate time.Duration // no rate limit (txoutbox.Forever): concurrency alone bounds it
	if c.cfg.GroupRate > 0 {
		byRate = time.Duration(float64(c.cfg.BatchSize) / c.cfg.GroupRate * float64(time.Second))
	}
	return max(byConc, byRate) + 2*c.cfg.RequestTimeout
}

func (c *CheckBack) limiter(group string) *groupLimit {
	c.limMu.Lock()
	defer c.limMu.Unlock()
	l := c.limiters[group]
	if l == nil {
		limit := rate.Limit(c.cfg.GroupRate)
		if c.cfg.GroupRate == txoutbox.Forever {
			limit = rate.Inf
		}
		l = &groupLimit{
			rate: rate.NewLimiter(limit, c.cfg.GroupConcurrency),
			sem:  make(chan struct{}, c.cfg.GroupConcurrency),
		}
		c.limiters[group] = l
	}
	return l
}

// acquire takes a concurrency slot, then waits for the rate (a slot is held only while a
// request is out). It reports false when ctx ended first.
func (l *groupLimit) acquire(ctx context.Context) bool {
	select {
	case l.sem <- struct{}{}:
	case <-ctx.Done():
		return false
	}
	if err := l.rate.Wait(ctx); err != nil {
		<-l.sem
		return false
	}
	return true
}

// checkOnce claims due checker rows (leasing them) of groups not already being asked, and asks
// each group's checker — within the group's concurrency and rate — in a unit of its own, which
// records each answer and gives back what it could not ask. With wait it returns when every
// unit is done; otherwise at once (units run on, and Run waits for them on shutdown).
func (c *CheckBack) checkOnce(ctx context.Context, res *ResolveResult, wait bool) error {
	if !wait {
		// The units outlive this call: they count into a result of their own, not the
		// caller's (metrics and logs still see every check).
		res = &ResolveResult{Checks: map[string]int{}}
	}
	if _, err := c.outbox(ctx); err != nil {
		return err
	}
	lease := c.lease()
	rows, err := c.q.ClaimChecks(ctx, c.db, c.cfg.transactionTimeout(), c.cfg.BatchSize, lease, c.busyGroups())
	if err != nil {
		return fmt.Errorf("claim checks: %w", err)
	}
	byGroup := map[string][]store.HalfRow{}
	for _, r := range rows {
		byGroup[r.Group] = append(byGroup[r.Group], r)
	}
	var mu sync.Mutex // guards res and errs
	var errs []error
	var units sync.WaitGroup
	for group, rows := range byGroup {
		c.setBusy(group, true)
		units.Add(1)
		c.bg.Add(1)
		go func() {
			defer c.bg.Done()
			defer units.Done()
			defer c.setBusy(group, false)
			err := c.askGroup(ctx, rows, lease, res, &mu)
			if !wait && ctx.Err() == nil {
				c.recordedGroup(group, err)
			}
			if err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	if !wait {
		return nil
	}
	units.Wait()
	return errors.Join(errs...)
}

// recordedGroup logs and counts how a scheduled pass's unit of group ended, whose error (err)
// no caller sees: the resolve job returned before it. A group whose checks cannot be recorded
// (PostgreSQL failing, for one) is one warning when it starts failing, a debug line for each
// failed unit after it, and one info line when a unit of the group succeeds again, as runJob
// logs a job; each failed unit counts in txoutbox_checkback_job_errors_total{job="resolve"}.
// With wait (RunOnce) the errors go back to the job, which runJob logs and counts instead.
//
// A group has units only while it has due checks: a failure more than three leases after the
// group's previous one is a new failure (its rows were settled or given back meanwhile, and
// whether the group recovered went unseen), logged as one.
func (c *CheckBack) recordedGroup(group string, err error) {
	n := c.groupFailures.recordAt(group, err != nil, time.Now(), 3*c.lease())
	switch {
	case err != nil && n == 0:
		c.m.jobErrors.WithLabelValues("resolve").Inc()
		c.log.Warn("check-back: recording a producer group's checks failed; its rows are asked again later "+
			"(further failures of the group are logged at debug level until its checks are recorded again)", "group", group, "err", err)
	case err != nil:
		c.m.jobErrors.WithLabelValues("resolve").Inc()
		c.log.Debug("check-back: recording a producer group's checks failed again", "group", group, "failed_passes", n+1, "err", err)
	case n > 0:
		c.log.Info("check-back: a producer group's checks are recorded again", "group", group, "failed_passes", n)
	}
}

// askGroup asks the checker of one group about its claimed rows and records the answers; rows
// it could not ask before the lease runs out are given back.
func (c *CheckBack) askGroup(ctx context.Context, rows []store.HalfRow, lease time.Duration, res *ResolveResult, mu *sync.Mutex) error {
	// Stop asking before the lease runs out, so that no other pass takes the same rows.
	pctx, cancel := context.WithTimeout(ctx, lease-c.cfg.RequestTimeout)
	defer cancel()
	var released []uuid.UUID
	var errs []error
	var cmu sync.Mutex // guards released and errs
	release := func(rows []store.HalfRow) {
		cmu.Lock()
		for _, r := range rows {
			released = append(released, r.MessageID)
		}
		cmu.Unlock()
	}
	// Rows of one key are asked one after another, oldest first, so that answers in one pass
	// commit them in the order they were prepared; other rows are asked concurrently, within
	// their group's concurrency and rate.
	lim := c.limiter(rows[0].Group)
	var wg sync.WaitGroup
	for _, chain := range chains(rows) {
		wg.Add(1)
		go func(chain []store.HalfRow) {
			defer wg.Done()
			for i, r := range chain {
				if !lim.acquire(pctx) {
					release(chain[i:])
					return
				}
				outcome, detail := c.ask(pctx, r)
				<-lim.sem
				if outcome == "" { // the pass itself ran out of time: not the checker's fault
					release(chain[i:])
					return
				}
				if err := c.record(ctx, r, outcome, detail, res, mu); err != nil {
					cmu.Lock()
					errs = append(errs, err)
					cmu.Unlock()
				}
			}
		}(chain)
	}
	wg.Wait()
	if len(released) > 0 {
		rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer rcancel()
		if err := c.q.ReleaseChecks(rctx, c.db, released); err != nil {
			errs = append(errs, fmt.Errorf("release claimed rows: %w", err))
		}
		mu.Lock()
		res.Released += len(released)
		mu.Unlock()
	}
	return errors.Join(errs...)
}

// busyGroups lists the groups whose checkers are being asked by an earlier pass.
func (c *CheckBack) busyGroups() []string {
	c.busyMu.Lock()
	defer c.busyMu.Unlock()
	out := make([]string, 0, len(c.busy))
	for g := range c.busy {
		out = append(out, g)
	}
	return out
}

func (c *CheckBack) setBusy(group string, busy bool) {
	c.busyMu.Lock()
	defer c.busyMu.Unlock()
	if busy {
		c.busy[group] = true
	} else {
		delete(c.busy, group)
	}
}

// chains splits rows into sequences to ask in order: the rows of one group and key, by id
// (prepare order), and every unkeyed row on its own.
func chains(rows []store.HalfRow) [][]store.HalfRow {
	var out [][]store.HalfRow
	byKey := map[[2]string]int{}
	for _, r := range rows {
		if r.Key == "" {
			out = append(out, []store.HalfRow{r})
			continue
		}
		k := [2]string{r.Group, r.Key}
		if i, ok := byKey[k]; ok {
			out[i] = append(out[i], r)
			continue
		}
		byKey[k] = len(out)
		out = append(out, []store.HalfRow{r})
	}
	for _, ch := range out {
		sort.Slice(ch, func(i, j int) bool { return ch[i].ID < ch[j].ID })
	}
	return out
}

// ask asks row's group's checker and classifies the reply. It returns "" as the outcome when
// ctx ended first (the pass ran out of time or is shutting down): nothing is counted.
func (c *CheckBack) ask(ctx context.Context, r store.HalfRow) (outcome, detail string) {
	ctx, span := c.trace.startCheck(ctx, r, c.cfg.SubjectPrefix)
	outcome, detail = c.askChecker(ctx, r)
	endCheck(span, outcome, detail)
	return outcome, detail
}

// askChecker is ask without its span; the request carries the trace context of ctx.
func (c *CheckBack) askChecker(ctx context.Context, r store.HalfRow) (outcome, detail string) {
	if c.nc == nil {
		return OutcomeNoResponders, "no NATS connection: the check-back cannot ask checkers"
	}
	// Our own connection being down is not the checker's fault: postpone, count nothing.
	if !c.natsUp() {
		return "", ""
	}
	id, _ := c.outbox(ctx) // known: checkOnce asked for it before claiming
	req := checker.Request{MessageID: r.MessageID, Subject: r.Subject, Key: r.Key, Group: r.Group,
		Check: int(r.CheckCount) + 1, PreparedAt: r.CreatedAt, Outbox: id}
	if len(r.Headers) > 0 {
		// The producer stored them (EnqueueTx, Prepare and the SQL functions write a JSON
		// object of string arrays): a row they do not decode is a bug or a hand-made row. Ask
		// nothing rather than ask without them (the checker's answer may depend on them):
		// the check is an error, recorded on the row (last_error) and retried up to
		// MaxChecks like any, and logged here.
		if err := json.Unmarshal(r.Headers, &req.Headers); err != nil {
			detail := "stored headers are not a JSON object of string arrays (" + err.Error() + "): the checker is not asked"
			c.log.Error("check-back: a half message's stored headers do not decode; its checker is not asked",
				"message_id", r.MessageID.String(), "group", r.Group, "err", err)
			return OutcomeError, detail
		}
	}
	body, err := json.Marshal(req)
	if err != nil {
		return OutcomeError, "encode request: " + err.Error()
	}
	msg := nats.NewMsg(checker.Subject(c.cfg.SubjectPrefix, r.Group))
	msg.Data = body
	msg.Header.Set(checker.HeaderTimeout, c.cfg.RequestTimeout.String())
	c.trace.p.Inject(ctx, tracing.Carrier(msg.Header))
	rctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
	defer cancel()
	resp, err := c.nc.RequestMsgWithContext(rctx, msg)
	switch {
	case err == nil:
	case ctx.Err() != nil || !c.natsUp():
		return "", ""
	case errors.Is(err, nats.ErrNoResponders):
		return OutcomeNoResponders, "no checker serves " + msg.Subject
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout):
		return OutcomeTimeout, fmt.Sprintf("no answer from %s within %s", msg.Subject, c.cfg.RequestTimeout)
	default:
		return OutcomeError, "request: " + err.Error()
	}
	if e := resp.Header.Get(micro.ErrorHeader); e != "" {
		return OutcomeError, fmt.Sprintf("checker error %s: %s", resp.Header.Get(micro.ErrorCodeHeader), e)
	}
	st, err := outbox.ParseLocalState(string(resp.Data))
	if err != nil {
		return OutcomeMalformed, fmt.Sprintf("malformed reply: %q is not COMMIT, ROLLBACK or UNKNOWN", safetext.Text(string(resp.Data), 64))
	}
	switch st {
	case outbox.StateCommit:
		return OutcomeCommit, ""
	case outbox.StateRollback:
		return OutcomeRollback, ""
	}
	return OutcomeUnknown, "checker answered UNKNOWN"
}

// OutboxIdentity returns the identity of the outbox this check-back sends with its checks, the
// one its producers' checkers must serve (checker.Config.Outbox): Config.Outbox, or, when that
// is empty, checker.OutboxIdentity of its pool and schema, read once (at the first check, or
// here) and kept. Config().Outbox stays as configured.
func (c *CheckBack) OutboxIdentity(ctx context.Context) (string, error) { return c.outbox(ctx) }

// outbox returns the identity of the outbox this check-back asks about: Config.Outbox, or
// OutboxIdentity of its pool and schema, read once (and logged once).
func (c *CheckBack) outbox(ctx context.Context) (string, error) {
	c.outboxMu.Lock()
	defer c.outboxMu.Unlock()
	if c.outboxID != "" {
		return c.outboxID, nil
	}
	id := c.cfg.Outbox
	if id == "" {
		var err error
		if id, err = checker.OutboxIdentity(ctx, c.db, c.cfg.Schema); err != nil {
			return "", err
		}
		c.log.Info("check-back asks checkers as outbox "+id+": checkers must serve it (checker.Config.Outbox)", "outbox", id)
	}
	c.outboxID = id
	return id, nil
}

// natsUp reports whether the NATS connection is up, logging when that changes.
func (c *CheckBack) natsUp() bool {
	up := c.nc.IsConnected()
	if c.natsDown.Swap(!up) != !up {
		if up {
			c.log.Info("NATS connection back: asking checkers again")
		} else {
			c.log.Warn("NATS connection down: checks are postponed (not counted) until it is back", "status", c.nc.Status().String())
		}
	}
	return up
}

// record applies a check's outcome to its row, which may have been settled meanwhile by its
// producer (then nothing changes).
func (c *CheckBack) record(ctx context.Context, r store.HalfRow, outcome, detail string, res *ResolveResult, mu *sync.Mutex) error {
	// Finish recording even when ctx is being cancelled: the answer is in.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	c.m.checks.WithLabelValues(outcome).Inc()
	mu.Lock()
	res.Checks[outcome]++
	mu.Unlock()
	log := c.log.With("message_id", r.MessageID.String(), "group", r.Group, "check", r.CheckCount+1)
	if outcome == OutcomeCommit || outcome == OutcomeRollback {
		c.inconclusive.conclusive(c.log, r.Group)
		commit := outcome == OutcomeCommit
		verb, result, done, answer, count := "roll back", "rolled_back", "rolled back", "ROLLBACK", &res.RolledBack
		if commit {
			verb, result, done, answer, count = "commit", "committed", "committed", "COMMIT", &res.Committed
		}
		// A transaction: a commit takes the key's lock and draws the message's new id.
		var ok bool
		var state string
		err := pgx.BeginFunc(ctx, c.db, func(tx pgx.Tx) error {
			var err error
			ok, state, err = c.q.SettleHalf(ctx, tx, store.HalfSettle{MessageID: r.MessageID, Commit: commit,
				By: store.SettledByChecker, From: []string{store.StatePrepared}, CountCheck: true})
			return err
		})
		if err != nil && !errors.Is(err, store.ErrNoRow) {
			return fmt.Errorf("%s %s: %w", verb, r.MessageID, err)
		}
		if !ok {
			log.Debug("checker answered "+answer+" but the message was settled meanwhile", "state", state)
			return nil
		}
		c.m.resolved.WithLabelValues(result).Inc()
		mu.Lock()
		*count++
		mu.Unlock()
		log.Info("half message " + done + ": its checker answered " + answer)
		return nil
	}
	n := int(r.CheckCount) + 1
	delay := backoff(n, c.cfg.BackoffBase, c.cfg.BackoffMax, c.cfg.BackoffJitter)
	state, count, ok, err := c.q.RecordCheck(ctx, c.db, r.MessageID, outcome+": "+detail, delay, c.cfg.MaxChecks)
	if err != nil {
		return fmt.Errorf("record check of %s: %w", r.MessageID, err)
	}
	if !ok {
		return nil // settled meanwhile
	}
	if state == store.StateCheckExhausted {
		c.m.exhausted.Inc()
		mu.Lock()
		res.Exhausted++
		mu.Unlock()
		log.Error("half message check_exhausted: no COMMIT or ROLLBACK after the maximum number of checks; "+
			"list it with `"+cmdline.Command(c.cfg.Schema, "relay prepared list --state check_exhausted")+"`, then resume, commit or roll it back",
			"checks", count, "outcome", outcome, "detail", detail)
		return nil
	}
	c.inconclusive.inconclusive(log, r.Group, outcome, detail,
		"next_check_in", delay.Round(time.Millisecond).String(), "checks_left", c.cfg.MaxChecks-int(count))
	return nil
}
