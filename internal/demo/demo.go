package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/internal/ops"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
	"github.com/txoutbox/txoutbox/relay"
)

// Config configures the demo. The zero value is not usable; DefaultConfig is.
type Config struct {
	// DSN and NATSURL are the services to use; empty means find or start them (see Main).
	DSN, NATSURL string

	// Orders and Payments are how many orders and payments the producers make.
	Orders, Payments int
	// Rate is how many orders per second the orders producer makes (payments keep pace).
	Rate float64

	// Fault knobs.
	Rollback      float64 // fraction of order transactions the producer rolls back
	Poison        int     // orders the consumer can never handle (dead letters)
	LoseAcks      float64 // fraction of the relay's PubAcks lost on the wire
	ConsumerCrash float64 // per consumer commit: crash after it, before the ack
	Duplicates    float64 // fraction of orders whose event is enqueued a second time
	PaymentDie    float64 // fraction of payment producers that die before settling
	Decline       float64 // fraction of payments the provider declines

	// Timeout bounds the whole run.
	Timeout time.Duration
	// Keep keeps the demo's schema (and prints its name) instead of dropping it.
	Keep bool
	// Verbose shows the components' own logs.
	Verbose bool
	// Seed makes the random choices repeatable; 0 picks one.
	Seed uint64

	// MetricsAddr, when set, serves /metrics (one registry with every component's families:
	// relay, check-back, consumer, the producers' outbox client, and the Go and process
	// collectors), /healthz, /readyz and the status page there, e.g. 127.0.0.1:9090.
	MetricsAddr string
	// Linger keeps serving MetricsAddr this long after the summary, or until the context
	// passed to Run ends (Ctrl-C), so that a person can look at the metrics of the run.
	Linger time.Duration
}

// DefaultConfig is what `go run ./cmd/producer-demo` runs.
func DefaultConfig() Config {
	return Config{
		Orders: 200, Payments: 40, Rate: 80,
		Rollback: 0.05, Poison: 3, LoseAcks: 0.03, ConsumerCrash: 0.02, Duplicates: 0.05,
		PaymentDie: 0.2, Decline: 0.15,
		Timeout: 2 * time.Minute,
	}
}

// Demo timings: short, so that the check-back and the redeliveries happen within seconds.
const (
	demoAckWait            = 2 * time.Second
	demoTransactionTimeout = time.Second
	demoGiveUp             = 2 * time.Second
	demoPublishTimeout     = 500 * time.Millisecond
)

// run is one demo run.
type run struct {
	cfg Config
	out io.Writer
	log *slog.Logger

	svc        *services
	schema     string
	ownStreams bool          // streams created on an external NATS, deleted at exit
	pool       *pgxpool.Pool // producers, checker, checks
	nc         *nats.Conn
	js         jetstream.JetStream
	relay      *relay.Relay
	loss       *ackLoss
	prod       *producer
	chk        *payChecker
	cons       consumerSup
	start      time.Time

	reg *prometheus.Registry // nil without MetricsAddr
	ops *ops.Server
}

// consumerSup runs the inventory consumer in-process and restarts it after each crash.
type consumerSup struct {
	mu      sync.Mutex
	cur     *consumer.Consumer
	crash   func() // crashes the current instance: its connection dies under it
	done    [6]int64
	crashes atomic.Int64
}

// totals returns processed, duplicates, retries, dead-lettered, unavailable and ack failures,
// summed over every instance so far.
func (s *consumerSup) totals() [6]int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.done
	if s.cur != nil {
		for i, v := range statsOf(s.cur.Stats()) {
			t[i] += v
		}
	}
	return t
}

func statsOf(st consumer.Stats) [6]int64 {
	return [6]int64{st.Processed, st.Duplicates, st.Retries, st.DeadLettered, st.Unavailable, st.AckFailures}
}

// Result is what a demo run did (the counters of its components) and found (the end state).
type Result struct {
	*Tally
	// LostAcks counts the relay's PubAcks lost on the wire; RelayDuplicates the relay's
	// republishes that JetStream reported as duplicates.
	LostAcks, RelayDuplicates int64
	// ConsumerCrashes counts crashes between commit and ack; the others are the consumer's
	// Stats, summed over its instances.
	ConsumerCrashes, ConsumerProcessed, ConsumerDuplicates, ConsumerRetries, ConsumerDeadLettered int64
	// Checker answers.
	CheckerCommit, CheckerRollback, CheckerUnknown int64
	Elapsed                                        time.Duration
}

// Run runs the demo and prints its story and summary to out. It returns what happened and an
// error when the run itself failed (a service could not start, a component stopped on an
// error that restarting cannot fix, the timeout passed).
func Run(ctx context.Context, cfg Config, out io.Writer) (*Result, error) {
	if cfg.Seed == 0 {
		cfg.Seed = rand.Uint64()
	}
	r := &run{cfg: cfg, out: out, start: time.Now()}
	level := slog.LevelError + 1 // quiet: the demo tells the story itself
	if cfg.Verbose {
		level = slog.LevelInfo
	}
	r.log = slog.New(slog.NewTextHandler(out, &slog.HandlerOptions{Level: level}))
	parent := ctx
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	defer r.close()
	if err := r.setup(ctx); err != nil {
		return nil, err
	}
	res, err := r.main(ctx)
	if err == nil {
		r.linger(parent)
	}
	return res, err
}

func (r *run) say(format string, args ...any) { fmt.Fprintf(r.out, format+"\n", args...) }

func (r *run) setup(ctx context.Context) error {
	r.say("txoutbox demo: producer → outbox → relay → JetStream → idempotent consumer, with faults injected.")
	r.say("")
	svc, err := startServices(ctx, serviceOptions{DSN: r.cfg.DSN, NATSURL: r.cfg.NATSURL, Keep: r.cfg.Keep, Log: func(f string, a ...any) { r.say("  "+f, a...) }})
	if err != nil {
		return err
	}
	r.svc = svc
	r.schema = "txoutbox_demo_" + randomSuffix()
	r.say("PostgreSQL: %s; schema %s", svc.PostgresFrom, r.schema)
	r.say("NATS:       %s", svc.NATSFrom)

	if r.pool, err = newPool(ctx, svc.DSN, r.schema, "txoutbox-demo-producer", 16); err != nil {
		return err
	}
	if err := createSchema(ctx, r.pool, r.schema, &businessSetup{SKUs: 20, Customers: 50}); err != nil {
		return err
	}
	if r.nc, err = connectNATS(svc.NATSURL, "txoutbox-demo"); err != nil {
		return fmt.Errorf("connect to NATS: %w", err)
	}
	if r.js, err = jetstream.New(r.nc); err != nil {
		return err
	}
	if svc.NATS == nil {
		// Someone else's server: never touch streams the demo did not create, and remove its
		// own at exit.
		for _, name := range []string{streamName, deadStreamName} {
			if _, err := r.js.Stream(ctx, name); err == nil {
				return fmt.Errorf("stream %s already exists at NATS_URL (a previous demo run kept with -keep?): remove it, or unset NATS_URL to use an embedded server", name)
			}
		}
		r.ownStreams = true
	}
	if err := createStreams(ctx, r.js); err != nil {
		var oe *streamOverlapError
		if errors.As(err, &oe) && svc.NATS == nil {
			return fmt.Errorf("%w.\n  Remove or change %s at NATS_URL, or unset NATS_URL to use an embedded server", err, oe.them())
		}
		return err
	}
	return nil
}

// createStreams creates the demo's stream (two-minute duplicate window) and its dead-letter
// stream.
func createStreams(ctx context.Context, js jetstream.JetStream) error {
	return createStreamsReplicas(ctx, js, 1, 2*time.Minute)
}

// createStreamsReplicas is createStreams with the given number of replicas per stream and
// duplicate window.
func createStreamsReplicas(ctx context.Context, js jetstream.JetStream, replicas int, dup time.Duration) error {
	for _, cfg := range []jetstream.StreamConfig{
		{Name: streamName, Subjects: streamSubjects, Storage: jetstream.FileStorage, Duplicates: dup, Replicas: replicas},
		{Name: deadStreamName, Subjects: []string{consumer.DefaultDeadLetterPrefix + durableName}, Storage: jetstream.FileStorage, Duplicates: dup, Replicas: replicas},
	} {
		if _, err := js.CreateOrUpdateStream(ctx, cfg); err != nil {
			var apiErr *jetstream.APIError
			if errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrCodeSubjectsOverlap {
				return &streamOverlapError{Stream: cfg.Name, Subjects: cfg.Subjects, Others: overlappingStreams(ctx, js, cfg), Err: err}
			}
			return fmt.Errorf("create stream %s: %w", cfg.Name, err)
		}
	}
	return nil
}

// jsErrCodeSubjectsOverlap is nats-server's error code for a stream whose subjects overlap
// another stream's (JSStreamSubjectOverlapErr, "subjects overlap with an existing stream");
// nats.go has no name for it.
const jsErrCodeSubjectsOverlap jetstream.ErrorCode = 10065

// streamOverlapError is a demo stream the server refused because another stream captures
// some of its subjects. The server does not say which; Others are the ones found.
type streamOverlapError struct {
	Stream   string
	Subjects []string
	Others   []string // "NAME (subject, …)"; empty when the lookup failed
	Err      error
}

func (e *streamOverlapError) Error() string {
	verb := "captures"
	if len(e.Others) > 1 {
		verb = "capture"
	}
	return fmt.Sprintf("cannot create stream %s for %s: %s %s some of them, and a subject belongs to one stream only",
		e.Stream, strings.Join(e.Subjects, ", "), e.who(), verb)
}

func (e *streamOverlapError) Unwrap() error { return e.Err }

// who names the streams in the way.
func (e *streamOverlapError) who() string {
	switch len(e.Others) {
	case 0:
		return "an existing stream (the server does not say which)"
	case 1:
		return "stream " + e.Others[0]
	}
	return "streams " + strings.Join(e.Others, ", ")
}

// them is who, short.
func (e *streamOverlapError) them() string {
	switch len(e.Others) {
	case 0:
		return "that stream"
	case 1:
		return "it"
	}
	return "them"
}

// overlappingStreams returns the streams other than cfg's that capture some of cfg's
// subjects, each with its subjects, or nil if the server does not say.
func overlappingStreams(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig) []string {
	var out []string
	for _, subj := range cfg.Subjects {
		l := js.ListStreams(ctx, jetstream.WithStreamListSubject(subj))
		for info := range l.Info() { // read to the end: the lister's goroutine waits for it
			name := fmt.Sprintf("%s (%s)", info.Config.Name, strings.Join(info.Config.Subjects, ", "))
			if info.Config.Name != cfg.Name && !slices.Contains(out, name) {
				out = append(out, name)
			}
		}
		if l.Err() != nil {
			return nil
		}
	}
	return out
}

func (r *run) close() {
	if r.ops != nil {
		r.ops.Close()
	}
	if r.nc != nil {
		if r.ownStreams && !r.cfg.Keep {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			for _, name := range []string{streamName, deadStreamName} {
				_ = r.js.DeleteStream(ctx, name)
			}
			cancel()
		}
		r.nc.Close()
	}
	if r.loss != nil {
		r.loss.Close()
	}
	if r.pool != nil {
		if !r.cfg.Keep {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			_ = dropSchema(ctx, r.pool, r.schema)
			cancel()
		}
		r.pool.Close()
	}
	if r.svc != nil {
		r.svc.Close()
	}
}

func (r *run) main(ctx context.Context) (*Result, error) {
	cfg := r.cfg
	r.say("")
	r.say("The chain:")
	r.say("  orders producer    %d orders at %.0f/s; each inserts its order row and its outbox message in one transaction (EnqueueTx)", cfg.Orders, cfg.Rate)
	r.say("  payments producer  %d half messages: prepare, charge at the provider, then commit or roll back (SendInTransaction)", cfg.Payments)
	r.say("  relay              publishes committed outbox rows to JetStream (Nats-Msg-Id = message id), then settles them")
	r.say("  check-back         asks the payments checker (checker.Serve) about half messages still prepared after %s", demoTransactionTimeout)
	r.say("  consumer           inventory/points: dedup row + stock or points + ledger row in one transaction, ack after commit")
	r.say("Faults injected:")
	r.say("  %4.0f%% of order transactions rolled back by the producer after writing the order and the message", 100*cfg.Rollback)
	r.say("  %4.0f%% of order events enqueued twice (a retrying producer: new message id, same business key)", 100*cfg.Duplicates)
	r.say("  %4.0f%% of the relay's PubAcks lost on the wire (the relay times out after %s and republishes)", 100*cfg.LoseAcks, demoPublishTimeout)
	r.say("  %4.1f%% of consumer commits followed by a crash before the ack (redelivered after the %s ack wait)", 100*cfg.ConsumerCrash, demoAckWait)
	r.say("  %4d poisoned orders the consumer always fails on (retried with backoff, then dead-lettered)", cfg.Poison)
	r.say("  %4.0f%% of payment producers die before settling (half after charging: COMMIT; half before: ROLLBACK)", 100*cfg.PaymentDie)
	r.say("  %4.0f%% of payments declined by the provider (rolled back)", 100*cfg.Decline)
	r.say("")

	// Producers' client: rings the relay's doorbell after each commit.
	if cfg.MetricsAddr != "" {
		r.reg = prometheus.NewRegistry()
		r.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: r.schema, Doorbell: outbox.NewNATSDoorbell(r.nc, ""), Registerer: r.registerer()})
	if err != nil {
		return nil, err
	}
	r.prod = &producer{pool: r.pool, client: client, customers: 50, skus: 20}
	r.chk = &payChecker{pool: r.pool, giveUp: demoGiveUp}
	outboxID, err := checker.OutboxIdentity(ctx, r.pool, r.schema)
	if err != nil {
		return nil, err
	}
	srv, err := checker.Serve(r.nc, paymentsGroup, r.chk.check, &checker.Config{Logger: r.log, Outbox: outboxID})
	if err != nil {
		return nil, fmt.Errorf("serve the payments checker: %w", err)
	}
	defer func() { _ = srv.Stop() }()

	// The relay, through the ack-losing proxy when PubAcks are to be lost.
	relayPool, err := newPool(ctx, r.svc.DSN, r.schema, "txoutbox-demo-relay", 8)
	if err != nil {
		return nil, err
	}
	defer relayPool.Close()
	relayURL := r.svc.NATSURL
	if target, ok := plainHostPort(r.svc.NATSURL); cfg.LoseAcks > 0 && ok {
		if r.loss, err = newAckLoss(target, cfg.LoseAcks); err != nil {
			return nil, err
		}
		relayURL = r.loss.URL()
	} else if cfg.LoseAcks > 0 {
		r.say("(PubAcks are not lost with this NATS_URL: the proxy that loses them handles a plain nats://host:port only)")
	}
	relayNC, err := connectNATS(relayURL, "txoutbox-demo-relay")
	if err != nil {
		return nil, err
	}
	defer relayNC.Close()
	relayJS, err := jetstream.New(relayNC)
	if err != nil {
		return nil, err
	}
	r.relay, err = relay.New(relayPool, relayJS, &relay.Config{
		ID: "demo-relay", Schema: r.schema, PublishedRetention: time.Hour, PublishTimeout: demoPublishTimeout,
		PollMax: 200 * time.Millisecond, BackoffBase: 200 * time.Millisecond, BackoffMax: 2 * time.Second,
		LeaseInterval: 200 * time.Millisecond, Subjects: streamSubjects, Logger: r.log,
		Registerer: r.registerer(), SampleInterval: time.Second,
	})
	if err != nil {
		return nil, err
	}
	cb, err := checkback.New(relayPool, r.nc, &checkback.Config{
		Schema: r.schema, TransactionTimeout: demoTransactionTimeout, BackoffBase: 500 * time.Millisecond, BackoffMax: 2 * time.Second,
		RequestTimeout: time.Second, ResolveSchedule: "@every 250ms", StaleSchedule: "off", PurgeSchedule: "off", Logger: r.log,
		Registerer: r.registerer(),
	})
	if err != nil {
		return nil, err
	}
	if err := r.serveMetrics(); err != nil {
		return nil, err
	}

	var wg sync.WaitGroup
	compCtx, stopComponents := context.WithCancel(context.WithoutCancel(ctx))
	defer func() { stopComponents(); wg.Wait() }()
	// A component that returns before compCtx ends stopped for good (the consumer's supervisor
	// restarts the demo's simulated crashes itself): the demo cannot finish without it, so it
	// ends, saying why, instead of waiting for its timeout.
	stopped := make(chan error, 3)
	wg.Add(3)
	go func() {
		defer wg.Done()
		if err := r.relay.Run(compCtx); err != nil {
			stopped <- r.explain("relay stopped", err)
		}
	}()
	go func() {
		defer wg.Done()
		if err := cb.Run(compCtx); err != nil {
			stopped <- r.explain("check-back stopped", err)
		}
	}()
	go func() {
		defer wg.Done()
		if err := r.superviseConsumer(compCtx); err != nil {
			stopped <- r.explain("consumer stopped", err)
		}
	}()

	// The producers.
	prodCtx, stopProducers := context.WithCancel(ctx)
	defer stopProducers()
	prodErr := make(chan error, 2)
	var produced sync.WaitGroup
	produced.Add(2)
	go func() { defer produced.Done(); prodErr <- r.produceOrders(prodCtx) }()
	go func() { defer produced.Done(); prodErr <- r.producePayments(prodCtx) }()
	producersDone := make(chan struct{})
	go func() { produced.Wait(); close(producersDone) }()

	r.say("Progress (orders/payments made · rows the relay published and settled · consumer: effects applied, duplicates caught, retries, dead letters · half messages open):")
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	ev := &events{}
	done := false
	for !done {
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("the demo did not finish within %s: %w", cfg.Timeout, ctx.Err())
		case err := <-stopped:
			return nil, err
		case err := <-prodErr:
			if err != nil {
				return nil, fmt.Errorf("producer: %w", err)
			}
			continue
		case <-tick.C:
		case <-producersDone:
			producersDone = nil // keep polling with the ticker from now on
		}
		open, err := r.progress(ctx, ev)
		if err != nil {
			return nil, err
		}
		if producersDone == nil && open == 0 {
			if done, err = r.quiet(ctx); err != nil {
				return nil, err
			}
		}
	}
	elapsed := time.Since(r.start)
	stopComponents()
	wg.Wait()

	vctx, vcancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer vcancel()
	t, err := verify(vctx, r.pool, r.js)
	if err != nil {
		return nil, err
	}
	r.summary(t, elapsed)
	if r.cfg.Keep {
		r.say("The schema %s is kept (-keep): look around with psql, then DROP SCHEMA %s CASCADE.", r.schema, r.schema)
	}
	ct := r.cons.totals()
	res := &Result{
		Tally: t, RelayDuplicates: r.relay.Stats().Duplicates,
		ConsumerCrashes: r.cons.crashes.Load(), ConsumerProcessed: ct[0], ConsumerDuplicates: ct[1], ConsumerRetries: ct[2], ConsumerDeadLettered: ct[3],
		CheckerCommit: r.chk.commit.Load(), CheckerRollback: r.chk.rollback.Load(), CheckerUnknown: r.chk.unknown.Load(),
		Elapsed: elapsed,
	}
	if r.loss != nil {
		res.LostAcks = r.loss.Dropped()
	}
	return res, nil
}

func (r *run) produceOrders(ctx context.Context) error {
	n := r.cfg.Orders
	rnd := rand.New(rand.NewPCG(r.cfg.Seed, 1)) // its own stream: the producers run concurrently
	poison := map[int]bool{}
	for len(poison) < min(r.cfg.Poison, n) {
		poison[rnd.IntN(n)] = true
	}
	interval := time.Duration(float64(time.Second) / r.cfg.Rate)
	next := time.Now()
	for i := range n {
		fate := orderNormal
		switch x := rnd.Float64(); {
		case poison[i]:
			fate = orderPoison
		case x < r.cfg.Rollback:
			fate = orderRollback
		case x < r.cfg.Rollback+r.cfg.Duplicates:
			fate = orderWithCopy
		}
		if err := r.prod.order(ctx, rnd, int64(i+1), fate); err != nil {
			return err
		}
		next = next.Add(interval)
		if err := sleepUntil(ctx, next); err != nil {
			return err
		}
	}
	return nil
}

func (r *run) producePayments(ctx context.Context) error {
	n := r.cfg.Payments
	if n == 0 {
		return nil
	}
	rnd := rand.New(rand.NewPCG(r.cfg.Seed, 2)) // its own stream: the producers run concurrently
	interval := time.Duration(float64(time.Second) * float64(r.cfg.Orders) / r.cfg.Rate / float64(n))
	next := time.Now()
	for i := range n {
		fate := fateCommit
		switch x := rnd.Float64(); {
		case x < r.cfg.PaymentDie/2:
			fate = fateDieBeforeCharge
		case x < r.cfg.PaymentDie:
			fate = fateDieAfterCharge
		case x < r.cfg.PaymentDie+r.cfg.Decline:
			fate = fateDecline
		}
		if err := r.prod.payment(ctx, rnd, int64(i+1), fate); err != nil {
			return err
		}
		next = next.Add(interval)
		if err := sleepUntil(ctx, next); err != nil {
			return err
		}
	}
	return nil
}

func sleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err()
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-tm.C:
		return nil
	}
}

// superviseConsumer runs the consumer until ctx ends, restarting it after each crash. A crash
// is the fault point between commit and ack: the instance's NATS connection dies under it, so
// its acks never leave, as if the process had died there. Only those crashes are restarted:
// it returns any other error of the consumer (see consumerExit).
func (r *run) superviseConsumer(ctx context.Context) error {
	pool, err := newPool(ctx, r.svc.DSN, r.schema, "txoutbox-demo-consumer", 8)
	if err != nil {
		return err
	}
	defer pool.Close()
	inv := &inventory{}
	var db txoutbox.Beginner = pool
	if r.cfg.ConsumerCrash > 0 {
		db = &crashAfterCommit{db: pool, p: r.cfg.ConsumerCrash, crash: func() {
			r.cons.mu.Lock()
			crash := r.cons.crash
			r.cons.mu.Unlock()
			if crash != nil {
				crash()
			}
		}}
	}
	for ctx.Err() == nil {
		nc, err := connectNATS(r.svc.NATSURL, "txoutbox-demo-consumer")
		if err != nil {
			return fmt.Errorf("connect to NATS: %w", err)
		}
		js, err := jetstream.New(nc)
		if err != nil {
			nc.Close()
			return err
		}
		c, err := consumer.New(db, js, inv.handle, &consumer.Config{
			Stream: streamName, Durable: durableName, Schema: r.schema, Concurrency: 4,
			MaxDeliveries: 5, BackoffBase: 200 * time.Millisecond, BackoffMax: time.Second,
			AckWait: demoAckWait, Logger: r.log, Registerer: r.registerer(),
		})
		if err != nil {
			nc.Close()
			return err
		}
		ictx, stop := context.WithCancel(ctx)
		var once sync.Once
		var crashed atomic.Bool
		r.cons.mu.Lock()
		r.cons.cur = c
		r.cons.crash = func() {
			once.Do(func() {
				crashed.Store(true)
				r.cons.crashes.Add(1)
				nc.Close() // the ack after this commit, and every other in flight, is lost
				stop()
			})
		}
		r.cons.mu.Unlock()
		err = c.Run(ictx)
		stop()
		nc.Close()
		r.cons.mu.Lock()
		for i, v := range statsOf(c.Stats()) {
			r.cons.done[i] += v
		}
		r.cons.cur, r.cons.crash = nil, nil
		r.cons.mu.Unlock()
		if restart, err := consumerExit(err, crashed.Load(), ctx.Err() != nil); !restart {
			return err
		}
		if !sleepCtx(ctx, 100*time.Millisecond) { // "restart"
			return nil
		}
	}
	return nil
}

// consumerExit decides what the supervisor does once an instance's Run returned err: after
// the demo's own simulated crash it restarts the consumer; when the demo is ending it stops;
// any other return ends the demo with the error. Run returns early only when restarting
// cannot help — a nats-server older than the consumer needs (txoutbox.ErrServerTooOld), a
// configuration refused (txoutbox.ErrInvalidConfig), no such stream or no dead-letter stream
// (Setup's answers: it waits out outages itself), or JetStream no longer delivering
// (consumer.ErrConsumeStopped) — and a restart would only repeat it, forever and unseen.
func consumerExit(err error, crashed, stopping bool) (restart bool, fatal error) {
	switch {
	case stopping:
		return false, nil
	case crashed:
		return true, nil
	case err == nil:
		return false, errors.New("the consumer returned before the demo ended")
	}
	return false, err
}

// explain wraps the error of a component that stopped for good with what to do about it.
func (r *run) explain(what string, err error) error {
	external := r.svc.NATS == nil
	var ve *txoutbox.ServerVersionError
	switch {
	case errors.As(err, &ve) && external:
		return fmt.Errorf("%s: %w.\n  Unset NATS_URL to use the embedded server, or point it at nats-server %s or later (the README's \"nats-server versions\" says what each component needs)",
			what, err, ve.Required)
	case errors.Is(err, txoutbox.ErrInvalidConfig):
		return fmt.Errorf("%s: its configuration was refused (a bug of the demo's): %w", what, err)
	case external && (errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, consumer.ErrNoDeadLetterStream) || errors.Is(err, consumer.ErrDeadLetterLoop)):
		return fmt.Errorf("%s: %w.\n  The demo created its streams %s and %s at NATS_URL: were they deleted or changed while it ran? Run it again, or unset NATS_URL to use an embedded server",
			what, err, streamName, deadStreamName)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// events remembers what was already told, so that each kind of event is explained once.
type events struct {
	crashes, lost, dups, dead, retries, checkCommit, checkRollback, checkUnknown int64
}

// progress prints one progress line, and a line for each new kind of event; it returns how
// many half messages are still open.
func (r *run) progress(ctx context.Context, ev *events) (int64, error) {
	var open int64
	if err := r.pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages WHERE state IN ('prepared', 'check_exhausted')`).Scan(&open); err != nil {
		return 0, fmt.Errorf("progress: %w", err)
	}
	var effects int64
	if err := r.pool.QueryRow(ctx, `SELECT count(*) FROM demo_effects`).Scan(&effects); err != nil {
		return 0, fmt.Errorf("progress: %w", err)
	}
	p := r.prod
	ct := r.cons.totals()
	rs := r.relay.Stats()
	r.say("  [%5.1fs] orders %d/%d  payments %d/%d · relay settled %d · applied %d, duplicates %d, retries %d, dead %d · half open %d",
		time.Since(r.start).Seconds(),
		p.ordersCommitted.Load()+p.ordersPoisoned.Load()+p.ordersRolledBack.Load(), r.cfg.Orders,
		p.paymentsPrepared.Load(), r.cfg.Payments,
		rs.Published, effects, ct[1], ct[2], ct[3], open)
	tell := func(seen *int64, now int64, format string, args ...any) {
		if now > *seen {
			if *seen == 0 {
				r.say("      ↳ "+format, args...)
			}
			*seen = now
		}
	}
	if r.loss != nil {
		tell(&ev.lost, r.loss.Dropped(), "a PubAck was lost on the wire: the relay's publish timed out, the row stayed ready and was published again")
	}
	tell(&ev.dups, rs.Duplicates, "JetStream answered a republish with \"duplicate\" (same Nats-Msg-Id within its 2m window): stored once")
	tell(&ev.crashes, r.cons.crashes.Load(), "the consumer crashed after its commit, before its ack; restarted: JetStream redelivers after the ack wait, the dedup row turns it into a duplicate")
	tell(&ev.retries, ct[2], "a poisoned order failed in the consumer: rolled back (dedup row too), nak'ed with a growing delay")
	tell(&ev.dead, ct[3], "a poisoned order failed its last delivery: published to %s%s with its error, then terminated", consumer.DefaultDeadLetterPrefix, durableName)
	tell(&ev.checkCommit, r.chk.commit.Load(), "the check-back asked the payments checker about a half message whose producer died after charging: COMMIT → published")
	tell(&ev.checkUnknown, r.chk.unknown.Load(), "the checker answered UNKNOWN (no charge yet): the check-back asks again later, with backoff")
	tell(&ev.checkRollback, r.chk.rollback.Load(), "the checker answered ROLLBACK (the provider never charged it): the half message is dropped")
	return open, nil
}

// quiet reports whether everything has been delivered (see drained).
func (r *run) quiet(ctx context.Context) (bool, error) {
	return drained(ctx, r.pool, r.js)
}

// drained reports whether everything has been delivered: nothing ready or prepared in the
// outbox, every expected effect applied, a dead letter for every poisoned order, and nothing
// pending or unacked at the durable consumer.
func drained(ctx context.Context, db *pgxpool.Pool, js jetstream.JetStream) (bool, error) {
	// Bound every call: a request sent while NATS restarts may never be answered.
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var open, effects, expected, poisoned int64
	if err := db.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM txoutbox_messages WHERE state IN ('ready', 'prepared', 'check_exhausted')),
		(SELECT count(*) FROM demo_effects),
		(SELECT count(*) FROM demo_orders WHERE NOT poison) + (SELECT count(*) FROM demo_charges WHERE status = 'charged'),
		(SELECT count(*) FROM demo_orders WHERE poison)`).Scan(&open, &effects, &expected, &poisoned); err != nil {
		return false, fmt.Errorf("progress: %w", err)
	}
	if open > 0 || effects < expected {
		return false, nil
	}
	// NATS errors (it may be restarting) mean "not yet".
	c, err := js.Consumer(ctx, streamName, durableName)
	if err != nil {
		return false, nil
	}
	info, err := c.Info(ctx)
	if err != nil || info.NumPending > 0 || info.NumAckPending > 0 {
		return false, nil
	}
	s, err := js.Stream(ctx, deadStreamName)
	if err != nil {
		return false, nil
	}
	sinfo, err := s.Info(ctx)
	if err != nil {
		return false, nil
	}
	return int64(sinfo.State.Msgs) >= poisoned, nil
}

func (r *run) summary(t *Tally, elapsed time.Duration) {
	ct := r.cons.totals()
	rs := r.relay.Stats()
	line := func(label string, format string, args ...any) {
		r.say("    %-66s %s", label, fmt.Sprintf(format, args...))
	}
	r.say("")
	r.say("Summary (%.1fs, seed %d)", elapsed.Seconds(), r.cfg.Seed)
	r.say("  Producers")
	line("orders created (order row + message, one transaction)", "%d (+%d poisoned)", t.Orders, t.Poisoned)
	line("order transactions rolled back by the producer", "%d", t.RolledBackOrders)
	line("order events enqueued twice (new message id, same business key)", "%d", t.OrderCopies)
	line("payments: half messages prepared", "%d", t.Payments)
	line("  committed / rolled back by their producer", "%d / %d", t.HalfCommittedByProducer, t.HalfRolledBackByProducer)
	line("  producer died: resolved by the check-back (commit / rollback)", "%d / %d", t.HalfCommittedByCheckback, t.HalfRolledBackByCheckback)
	line("  checker answers (COMMIT / ROLLBACK / UNKNOWN)", "%d / %d / %d", r.chk.commit.Load(), r.chk.rollback.Load(), r.chk.unknown.Load())
	line("  still prepared", "%d", t.HalfUnsettled)
	r.say("  Relay → JetStream")
	line("messages published (settled by the relay)", "%d", rs.Published)
	line("messages stored in the stream (distinct message ids)", "%d (%d)", t.StreamMsgs, t.StreamDistinctIDs)
	lost := int64(0)
	if r.loss != nil {
		lost = r.loss.Dropped()
	}
	line("PubAcks lost on the wire (the relay published again)", "%d", lost)
	line("republishes dropped by JetStream as duplicates", "%d", rs.Duplicates)
	r.say("  Consumer (inventory/points)")
	line("deliveries handled", "%d", ct[0]+ct[1]+ct[2]+ct[3]+ct[4])
	line("effects applied (ledger rows)", "%d = %d orders + %d payments", t.Effects, t.OrderEffects, t.PaymentEffects)
	line("duplicates intercepted by the dedup table", "%d", ct[1])
	line("crashes between commit and ack (restarted)", "%d", r.cons.crashes.Load())
	line("handler failures retried", "%d", ct[2])
	line("dead letters (distinct messages)", "%d (%d)", t.DeadLetters, t.DeadDistinct)
	r.say("")
	printInvariants(r.out, t)
}

// plainHostPort returns host:port of a plain nats://host:port URL (no credentials, no list).
func plainHostPort(s string) (string, bool) {
	u, err := url.Parse(s)
	if err != nil || u.Scheme != "nats" || u.User != nil || u.Host == "" || strings.Contains(s, ",") {
		return "", false
	}
	return u.Host, true
}
