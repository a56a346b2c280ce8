package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/fault"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
	"github.com/txoutbox/txoutbox/relay"
)

// DefaultChaosMessages is the full size of the chaos proof.
const DefaultChaosMessages = 10_000

// Chaos settings.
const (
	chaosSchema      = "chaos"
	chaosRelayApp    = "txoutbox-relay" // relay run names its connections so (the lease one "txoutbox-relay <id>")
	chaosConsumerApp = "txoutbox-chaos-consumer"
	chaosProducerApp = "txoutbox-chaos-producer"
	// Fault points armed in the child processes: per relay batch, and per consumer commit.
	chaosRelayFault    = fault.RelayBeforeSettle + "=0.01"
	chaosConsumerFault = fault.ConsumerAfterCommit + "=0.003"
	chaosAckWait       = 2 * time.Second
	chaosGiveUp        = 10 * time.Second // the checker's patience with a payment it has never seen
	chaosRollback      = 0.05
	// The relays' timings (relay run flags). The lease interval is short so that a relay
	// frozen for a few seconds is fenced and its partitions taken while it is frozen.
	chaosRelays         = 3
	chaosPublishTimeout = 2 * time.Second
	chaosBackoffMax     = 2 * time.Second
	chaosLeaseInterval  = 250 * time.Millisecond
	chaosHandoverAfter  = relay.DefaultHandoverAfter
	// chaosFenceDelay is how long a relay's heartbeat stays unchanged before another relay
	// ends its lease session and takes its partitions: 11 lease intervals (see relay's lease.go).
	chaosFenceDelay = 11 * chaosLeaseInterval
)

// chaosDuplicateWindow is the streams' duplicate window: the shortest the relays' own start
// check accepts for their settings, so that a stale send (a frozen relay that wakes and sends
// what it claimed before it was fenced, say) is stored again, after later messages of its key,
// and fails the per-key order check instead of being absorbed by a generous window.
var chaosDuplicateWindow = (&relay.Config{PublishTimeout: chaosPublishTimeout, BackoffMax: chaosBackoffMax,
	HandoverAfter: chaosHandoverAfter, LeaseInterval: chaosLeaseInterval}).RequiredDuplicateWindow()

// Relay log messages the run counts (relay/lease.go, relay/publish.go).
const (
	logFenced   = "ended the lease session of a relay that stopped heartbeating"
	logWithheld = "partition lease ended before it could publish its whole batch"
)

// ErrChaosFaultMissing is returned by RunChaos, with the result, when a kind of fault it must
// inject never happened.
var ErrChaosFaultMissing = errors.New("chaos: a kind of fault never happened")

// ChaosConfig configures the chaos proof.
type ChaosConfig struct {
	// DSN is a PostgreSQL the run may create a database in. Empty: a throwaway cluster.
	DSN string
	// Messages is how many messages, at least, go through the whole chain (orders and
	// payments that commit). Defaults to DefaultChaosMessages.
	Messages int
	// ProduceFor spreads the producers' work over this long, while the faults are injected.
	// Defaults to Messages/100 seconds, at least 20s.
	ProduceFor time.Duration
	// Timeout bounds the whole run. Defaults to ProduceFor + 10m.
	Timeout time.Duration
	// RelayBin is the relay binary. Defaults to building ./cmd/relay with go build (which
	// needs the working directory inside the txoutbox module).
	RelayBin string
	// ConsumerExe and ConsumerEnv start a consumer process: ConsumerExe runs Main with the
	// arguments given (a demo binary built with the txoutbox_fault tag: the consumer's fault
	// point is armed with -fault, which only such a build has). Defaults to building
	// ./cmd/producer-demo so, as RelayBin.
	ConsumerExe string
	ConsumerEnv []string
	// Seed makes the random choices repeatable (not the timing); 0 picks one.
	Seed uint64
	// Keep keeps the chaos database.
	Keep bool
	// Relays is how many relay processes share the outbox's partitions (scale-out: each holds
	// partition leases, and takes the partitions of one that dies or freezes). Defaults to 3;
	// at least 2.
	Relays int
	// Cluster runs NATS as a three-node JetStream cluster on loopback with R3 streams, and
	// the relay and the consumers connect with every node's URL; the NATS fault is then a
	// SIGKILL-like kill of the stream leader's node (restarted with its store 0.5–4 s later)
	// or a leader step-down, instead of a server restart. Defaults to false: one embedded
	// server, restarted.
	Cluster bool
	// Out receives the progress and the report. Defaults to io.Discard.
	Out io.Writer
}

// ChaosResult is what a chaos run did and found.
type ChaosResult struct {
	Tally *Tally
	// Messages counts the messages that went through the chain: committed orders (poisoned
	// included) and charged payments.
	Messages int64

	// Relay counts are summed over the relay processes.
	Relays                                                                int
	RelayStarts, RelayKills, RelayFaultKills, RelayOtherExits             int64
	ConsumerStarts, ConsumerKills, ConsumerFaultKills, ConsumerOtherExits int64
	NATSRestarts                                                          int64
	RelayBackendsTerminated, ConsumerBackendsTerminated                   int64

	// Relay freezes (SIGSTOP, then SIGCONT some time later): how many, how many lasted less
	// than the lease interval, how many longer than the fence delay (another relay may end
	// the frozen one's lease session and take its partitions), and the longest. Fences counts
	// the lease sessions of relays that had been frozen that another relay ended (takeovers
	// of a frozen relay's partitions), OtherFences those of relays never frozen, and
	// WithheldBatches the batches a relay stopped sending because its lease had ended.
	RelayFreezes, ShortFreezes, LongFreezes    int64
	LongestFreeze                              time.Duration
	Fences, OtherFences, WithheldBatches       int64
	LeaseInterval, FenceDelay, DuplicateWindow time.Duration

	// With Cluster: kills of the node leading the stream (its routes cut first, so nothing is
	// handed over), successful leader step-downs, and how long the stream had no leader after
	// each kill (until a replica won the election), in kill order.
	LeaderKills, StepDowns int64
	Leaderless             []time.Duration

	// Observed on the wire by a core NATS subscription: every PubAck for the stream and how
	// many said "duplicate" (a republish the stream's duplicate window absorbed), and every
	// delivery to the durable consumer and how many were redeliveries.
	PubAcks, DuplicatePubAcks, Deliveries, Redeliveries int64
	// Reported by the consumer processes (each reports every 100ms, so a killed one loses its
	// last counts: lower bounds).
	ConsumerProcessed, ConsumerDuplicates int64

	Duration time.Duration
	// WorkDir holds the children's logs; it is removed when the run passes.
	WorkDir string
}

type chaos struct {
	cfg ChaosConfig
	out io.Writer

	workDir  string
	relayBin string
	svc      *services
	nats     *embedded.NATS
	admin    *pgxpool.Pool // on the DSN given, to create and drop the chaos database
	dbName   string        // the chaos database, when the run could create one
	dsn      string        // the chaos database's DSN
	pool     *pgxpool.Pool // producers, checker, terminations, checks
	nc       *nats.Conn
	js       jetstream.JetStream
	relays   []*proc
	consumer *proc
	prod     *producer
	chk      *payChecker

	cluster *embedded.Cluster // with Cluster, instead of nats
	natsURL string            // the server's URL, or every node's

	natsRestarts, relayTerminated, consumerTerminated atomic.Int64
	leaderKills, stepDowns                            atomic.Int64
	nodeDown                                          atomic.Bool    // a killed node is not restarted yet
	restarting                                        sync.WaitGroup // the restarts of killed nodes
	leaderlessMu                                      sync.Mutex
	leaderless                                        []time.Duration
	pubAcks, dupAcks, deliveries, redeliveries        atomic.Int64

	published chan struct{} // a message was published to the stream's subjects (seen on the wire)

	freezes, shortFreezes, longFreezes, fences, otherFences, withheld atomic.Int64
	longestFreeze                                                     atomic.Int64 // nanoseconds
	frozenIDs                                                         sync.Map     // relay ids ever frozen
	frozenNow                                                         sync.Map     // relay ids frozen now

	statsMu   sync.Mutex
	statsDone [6]int64
	statsCur  [6]int64
}

// RunChaos runs the chaos proof: it sends at least cfg.Messages messages from producers in
// this process through the outbox, cfg.Relays relay processes (the real relay binary, sharing
// the partitions) and JetStream to an ordered consumer process, while it SIGKILLs the
// processes at random moments, freezes relays with SIGSTOP (some past the fence delay, so
// that the others take their partitions while they are frozen), arms their fault points (a
// relay kills itself between publish and settle, the consumer between commit and ack),
// restarts the NATS server (with cfg.Cluster: kills the stream leader's node or makes the
// leader step down) and terminates their PostgreSQL backends. When everything is delivered it
// stops them and checks the invariants from the database and the streams, the per-key order
// of the applied effects included.
func RunChaos(ctx context.Context, cfg ChaosConfig) (*ChaosResult, error) {
	if cfg.Messages <= 0 {
		cfg.Messages = DefaultChaosMessages
	}
	if cfg.ProduceFor <= 0 {
		cfg.ProduceFor = max(20*time.Second, time.Duration(cfg.Messages)*10*time.Millisecond)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = cfg.ProduceFor + 10*time.Minute
	}
	if cfg.Seed == 0 {
		cfg.Seed = rand.Uint64()
	}
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	if cfg.Relays <= 0 {
		cfg.Relays = chaosRelays
	}
	if cfg.Relays < 2 {
		return nil, fmt.Errorf("chaos: Relays is %d, want at least 2: a frozen relay's partitions must be taken over by another", cfg.Relays)
	}
	c := &chaos{cfg: cfg, out: cfg.Out}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	start := time.Now()
	res, err := c.run(ctx)
	passed := err == nil && res != nil && res.Tally.OK()
	c.close(passed)
	if res != nil {
		res.Duration = time.Since(start)
		res.WorkDir = c.workDir
		if passed {
			res.WorkDir = ""
		}
	}
	if err != nil && c.workDir != "" {
		err = fmt.Errorf("%w (the children's logs are in %s)", err, c.workDir)
	}
	return res, err
}

func (c *chaos) say(format string, args ...any) { fmt.Fprintf(c.out, format+"\n", args...) }

func (c *chaos) run(ctx context.Context) (*ChaosResult, error) {
	var err error
	if c.workDir, err = os.MkdirTemp("", "txoutbox-chaos-"); err != nil {
		return nil, err
	}
	c.say("txoutbox chaos proof: %d messages, producers spread over %s, seed %d; logs in %s", c.cfg.Messages, c.cfg.ProduceFor, c.cfg.Seed, c.workDir)
	c.say("%d relay processes (lease interval %s: a relay frozen past %s is fenced), ordered consumer, stream duplicate window %s (the shortest the relays accept)",
		c.cfg.Relays, chaosLeaseInterval, chaosFenceDelay, chaosDuplicateWindow)
	if c.cfg.Cluster {
		c.say("on a three-node JetStream cluster, R3 streams")
	}
	if err := c.setup(ctx); err != nil {
		return nil, err
	}

	// Observe PubAcks and deliveries on the wire, on a connection that reconnects faster than
	// the relay's (250ms), so that it is back first after a NATS restart.
	obsNC, err := nats.Connect(c.natsURL, nats.Name("txoutbox-chaos-observer"), nats.MaxReconnects(-1),
		nats.ReconnectWait(20*time.Millisecond), nats.ReconnectJitter(0, 0), nats.RetryOnFailedConnect(true),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	if err != nil {
		return nil, err
	}
	defer obsNC.Close()
	obs, err := obsNC.Subscribe("_INBOX.>", c.observe)
	if err != nil {
		return nil, err
	}
	_ = obs.SetPendingLimits(-1, -1)
	defer func() { _ = obs.Unsubscribe() }()
	// Publishes to the stream, so that some freezes hit a relay in the middle of a batch.
	c.published = make(chan struct{}, 1)
	for _, subj := range streamSubjects {
		sub, err := obsNC.Subscribe(subj, func(*nats.Msg) {
			select {
			case c.published <- struct{}{}:
			default:
			}
		})
		if err != nil {
			return nil, err
		}
		defer func() { _ = sub.Unsubscribe() }()
	}

	// The checker of the payments group lives with the producers.
	outboxID, err := checker.OutboxIdentity(ctx, c.pool, chaosSchema)
	if err != nil {
		return nil, err
	}
	srv, err := checker.Serve(c.nc, paymentsGroup, c.chk.check, &checker.Config{Outbox: outboxID})
	if err != nil {
		return nil, err
	}
	defer func() { _ = srv.Stop() }()

	for i := 1; i <= c.cfg.Relays; i++ {
		name := "relay-" + strconv.Itoa(i)
		relayLog, err := c.logFile(name + ".log")
		if err != nil {
			return nil, err
		}
		c.relays = append(c.relays, &proc{name: name, command: c.relayCmd(i), log: relayLog, onErrLine: c.relayLine})
	}
	consumerLog, err := c.logFile("consumer.log")
	if err != nil {
		return nil, err
	}
	c.consumer = &proc{name: "consumer", command: c.consumerCmd, log: consumerLog, onLine: c.consumerLine, onExit: c.consumerExit}
	all := append(slices.Clone(c.relays), c.consumer)
	var procs sync.WaitGroup
	procCtx, stopProcs := context.WithCancel(context.WithoutCancel(ctx))
	defer func() {
		stopProcs()
		for _, p := range all {
			p.kill()
		}
		procs.Wait()
	}()
	for _, p := range all {
		procs.Add(1)
		go func() { defer procs.Done(); p.run(procCtx) }()
	}

	// Producers, and the faults while they work.
	ordersTarget := c.cfg.Messages - c.cfg.Messages/10
	paymentsTarget := c.cfg.Messages / 10
	poison := max(3, c.cfg.Messages/1000)
	prodErr := make(chan error, 2)
	prodCtx, stopProducers := context.WithCancel(ctx)
	defer stopProducers()
	var producing sync.WaitGroup
	producing.Add(2)
	go func() { defer producing.Done(); prodErr <- c.produceOrders(prodCtx, ordersTarget, poison) }()
	go func() { defer producing.Done(); prodErr <- c.producePayments(prodCtx, paymentsTarget) }()
	producersDone := make(chan struct{})
	go func() { producing.Wait(); close(producersDone) }()

	injectCtx, stopInjecting := context.WithCancel(ctx)
	injected := make(chan struct{})
	go func() { defer close(injected); c.inject(injectCtx) }()
	defer func() { stopInjecting(); <-injected }()

	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	started := time.Now()
	var producedAt time.Time
	c.say("producing, and injecting faults …")
	for {
		select {
		case <-ctx.Done():
			c.progress(ctx, started)
			return nil, fmt.Errorf("chaos: not everything was delivered within %s: %w", c.cfg.Timeout, ctx.Err())
		case err := <-prodErr:
			if err != nil {
				return nil, fmt.Errorf("chaos: producer: %w", err)
			}
			continue
		case <-producersDone:
			producersDone = nil
			producedAt = time.Now()
			c.say("producers done after %.0fs; faults go on for a few more seconds, then everything must drain", time.Since(started).Seconds())
			continue
		case <-tick.C:
			c.progress(ctx, started)
		}
		if producedAt.IsZero() {
			continue
		}
		if time.Since(producedAt) > 5*time.Second {
			stopInjecting()
		}
		if time.Since(producedAt) < 6*time.Second {
			continue
		}
		ok, err := drained(ctx, c.pool, c.js)
		if err != nil {
			return nil, err
		}
		if ok {
			break
		}
	}
	stopInjecting()
	<-injected
	c.say("everything delivered after %.0fs; stopping the relays and the consumer", time.Since(started).Seconds())
	var stopping sync.WaitGroup
	for _, p := range all {
		stopping.Add(1)
		go func() { defer stopping.Done(); p.stop(30 * time.Second) }()
	}
	stopping.Wait()
	stopProcs()
	procs.Wait()

	vctx, vcancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer vcancel()
	t, err := verify(vctx, c.pool, c.js)
	if err != nil {
		return nil, err
	}
	if err := verifyAppliedOrder(vctx, c.pool, t); err != nil {
		return nil, err
	}
	res := c.result(t)
	c.report(res)
	if c.cfg.Cluster && (res.LeaderKills == 0 || res.StepDowns == 0) {
		return res, fmt.Errorf("%w: the stream leader's node was killed %d times and the leader stepped down %d times; want both",
			ErrChaosFaultMissing, res.LeaderKills, res.StepDowns)
	}
	if res.ShortFreezes == 0 || res.LongFreezes == 0 || res.Fences == 0 {
		return res, fmt.Errorf("%w: relays frozen %d times shorter than the lease interval and %d times past the fence delay, "+
			"and a frozen relay's partitions taken %d times; want each", ErrChaosFaultMissing, res.ShortFreezes, res.LongFreezes, res.Fences)
	}
	return res, nil
}

func (c *chaos) logFile(name string) (io.Writer, error) {
	f, err := os.Create(filepath.Join(c.workDir, name))
	if err != nil {
		return nil, err
	}
	return &syncWriter{f: f}, nil
}

func (c *chaos) setup(ctx context.Context) error {
	var err error
	if c.relayBin = c.cfg.RelayBin; c.relayBin == "" {
		c.relayBin = filepath.Join(c.workDir, "relay")
		c.say("building the relay: go build -o %s github.com/txoutbox/txoutbox/cmd/relay", c.relayBin)
		if out, err := exec.CommandContext(ctx, goTool(), "build", "-tags", "txoutbox_fault", "-o", c.relayBin, "github.com/txoutbox/txoutbox/cmd/relay").CombinedOutput(); err != nil {
			return fmt.Errorf("chaos: build the relay (run from inside the txoutbox module, or pass -relay-bin): %w\n%s", err, out)
		}
	}
	if c.cfg.ConsumerExe == "" {
		c.cfg.ConsumerExe = filepath.Join(c.workDir, "producer-demo")
		c.say("building the consumer: go build -tags txoutbox_fault -o %s github.com/txoutbox/txoutbox/cmd/producer-demo", c.cfg.ConsumerExe)
		if out, err := exec.CommandContext(ctx, goTool(), "build", "-tags", "txoutbox_fault", "-o", c.cfg.ConsumerExe, "github.com/txoutbox/txoutbox/cmd/producer-demo").CombinedOutput(); err != nil {
			return fmt.Errorf("chaos: build the consumer (run from inside the txoutbox module): %w\n%s", err, out)
		}
	}
	c.svc, err = startServices(ctx, serviceOptions{DSN: c.cfg.DSN, NoNATS: true, Keep: c.cfg.Keep, Log: func(f string, a ...any) { c.say(f, a...) }})
	if err != nil {
		return err
	}
	c.say("PostgreSQL: %s", c.svc.PostgresFrom)

	// A database of its own, so that terminating backends by application name touches only
	// this run's relay and consumer.
	if c.admin, err = pgxpool.New(ctx, c.svc.DSN); err != nil {
		return err
	}
	name := "txoutbox_chaos_" + randomSuffix()
	c.dsn = c.svc.DSN
	if _, err := c.admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		c.say("could not create a database of its own (%v): using the given one; backends are terminated by application name only", err)
	} else {
		c.dbName = name
		if c.dsn, err = withDatabase(c.svc.DSN, name); err != nil {
			return err
		}
		c.say("database %s (dropped at the end)", name)
	}
	if c.pool, err = newPool(ctx, c.dsn, chaosSchema, chaosProducerApp, 16); err != nil {
		return err
	}
	if err := createSchema(ctx, c.pool, chaosSchema, &businessSetup{SKUs: 50, Customers: 200}); err != nil {
		return err
	}

	// NATS is embedded here, whatever NATS_URL says: the run restarts it, or kills its nodes.
	if c.cfg.Cluster {
		if c.cluster, err = embedded.StartCluster(embedded.ClusterOptions{StoreDir: filepath.Join(c.workDir, "nats"), Name: "txoutbox-chaos"}); err != nil {
			return err
		}
		c.natsURL = c.cluster.URLs()
		c.say("NATS: three-node embedded JetStream cluster on %s (stream leaders killed and stepped down during the run)", c.natsURL)
	} else {
		if c.nats, err = embedded.StartNATS(embedded.NATSOptions{StoreDir: filepath.Join(c.workDir, "nats")}); err != nil {
			return err
		}
		c.natsURL = c.nats.URL()
		c.say("NATS: embedded nats-server with JetStream on %s (restarted during the run)", c.natsURL)
	}
	if c.nc, err = connectNATS(c.natsURL, "txoutbox-chaos-orchestrator"); err != nil {
		return err
	}
	if c.js, err = jetstream.New(c.nc); err != nil {
		return err
	}
	if c.cfg.Cluster {
		if err := c.createClusterStreams(ctx); err != nil {
			return err
		}
	} else if err := createStreamsReplicas(ctx, c.js, 1, chaosDuplicateWindow); err != nil {
		return err
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: chaosSchema}) // no doorbell: the relay polls
	if err != nil {
		return err
	}
	c.prod = &producer{pool: c.pool, client: client, customers: 200, skus: 50}
	c.chk = &payChecker{pool: c.pool, giveUp: chaosGiveUp}
	return nil
}

// close stops everything the run started; it drops the chaos database unless Keep is set and
// removes the work directory when the run passed.
func (c *chaos) close(passed bool) {
	if c.nc != nil {
		c.nc.Close()
	}
	if c.pool != nil {
		c.pool.Close()
	}
	if c.nats != nil {
		c.nats.Stop()
	}
	if c.cluster != nil {
		c.cluster.Shutdown()
	}
	if c.admin != nil {
		if c.dbName != "" && !c.cfg.Keep {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			if _, err := c.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{c.dbName}.Sanitize()+" WITH (FORCE)"); err != nil {
				c.say("could not drop database %s: %v", c.dbName, err)
			}
			cancel()
		} else if c.dbName != "" {
			c.say("database %s kept (-keep)", c.dbName)
		}
		c.admin.Close()
	}
	if c.svc != nil {
		c.svc.Close()
	}
	if passed && c.workDir != "" && !c.cfg.Keep {
		_ = os.RemoveAll(c.workDir)
	}
}

// childEnv is the environment of the children without the settings the orchestrator gives
// them as flags.
func childEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "TXOUTBOX_") || k == "DATABASE_URL" || k == "NATS_URL" {
			continue
		}
		env = append(env, kv)
	}
	return append(env, extra...)
}

// The first incarnation of the consumer and of the first relay is armed with probability 1,
// so that every run kills a relay between a publish and its settle, and the consumer between
// a commit and its ack, at least once; later ones (and the other relays) with the chaos
// probabilities.
func armed(n int, point, spec string) string {
	if n == 1 {
		return point + "=1"
	}
	return spec
}

// relayID names the n-th incarnation of the i-th relay process.
func relayID(i, n int) string { return "chaos-relay-" + strconv.Itoa(i) + "-" + strconv.Itoa(n) }

// relayCmd returns the command of the i-th relay process (from 1).
func (c *chaos) relayCmd(i int) func(n int) *exec.Cmd {
	return func(n int) *exec.Cmd {
		spec := chaosRelayFault
		if i == 1 {
			spec = armed(n, fault.RelayBeforeSettle, chaosRelayFault)
		}
		return c.relayCmdSpec(relayID(i, n), spec)
	}
}

func (c *chaos) relayCmdSpec(id, faults string) *exec.Cmd {
	cmd := exec.Command(c.relayBin, "run",
		"--database-url", c.dsn, "--nats-url", c.natsURL, "--schema", chaosSchema,
		"--relay-id", id, "--subjects", strings.Join(streamSubjects, ","),
		"--poll-max", "100ms", "--publish-timeout", chaosPublishTimeout.String(), "--backoff-base", "200ms",
		"--backoff-max", chaosBackoffMax.String(), "--lease-interval", chaosLeaseInterval.String(),
		"--handover-after", chaosHandoverAfter.String(), "--retention", "1h", "--no-doorbell",
		"--check-transaction-timeout", "1s", "--check-backoff-base", "500ms", "--check-backoff-max", "2s",
		// A check-back killed mid-pass leaves the rows it claimed leased for about
		// ceil(batch/concurrency)·request timeout + 2·request timeout: keep that short.
		"--check-request-timeout", "1s", "--check-batch-size", "20", "--check-max", "1000", "--check-schedule", "@every 250ms",
		"--stale-schedule", "off", "--purge-schedule", "off",
		"--fault", faults)
	cmd.Env = childEnv()
	return cmd
}

// relayLine counts, from a relay's log, the fences (another relay ended the lease session of
// one that stopped heartbeating: of a frozen relay, a takeover while it is frozen) and the
// batches a relay stopped sending because its lease had ended.
func (c *chaos) relayLine(_ int, line string) {
	switch {
	case strings.Contains(line, logFenced):
		id := logAttr(line, "relay_id")
		if _, frozen := c.frozenIDs.Load(id); frozen {
			c.fences.Add(1)
		} else {
			c.otherFences.Add(1)
		}
	case strings.Contains(line, logWithheld):
		c.withheld.Add(1)
	}
}

// logAttr returns the value of the last key=value in a slog text line (a relay's log lines
// start with its own relay_id; the fence line names the fenced relay's after it).
func logAttr(line, key string) string {
	i := strings.LastIndex(line, " "+key+"=")
	if i < 0 {
		return ""
	}
	v, _, _ := strings.Cut(line[i+len(key)+2:], " ")
	return strings.Trim(v, `"`)
}

func (c *chaos) consumerCmd(n int) *exec.Cmd {
	batch := "1"
	if n%3 == 0 {
		batch = "16" // every third incarnation runs in batch mode: one commit, then the acks
	}
	cmd := exec.Command(c.cfg.ConsumerExe, "-role", "consumer",
		"-database-url", c.dsn, "-nats-url", c.natsURL, "-schema", chaosSchema,
		"-app-name", chaosConsumerApp, "-ack-wait", chaosAckWait.String(), "-batch", batch,
		"-fault", armed(n, fault.ConsumerAfterCommit, chaosConsumerFault))
	cmd.Env = childEnv(c.cfg.ConsumerEnv...)
	return cmd
}

func (c *chaos) consumerLine(_ int, line string) {
	if st, ok := parseStats(line); ok {
		c.statsMu.Lock()
		c.statsCur = st
		c.statsMu.Unlock()
	}
}

func (c *chaos) consumerExit(int) {
	c.statsMu.Lock()
	for i, v := range c.statsCur {
		c.statsDone[i] += v
	}
	c.statsCur = [6]int64{}
	c.statsMu.Unlock()
}

func (c *chaos) consumerStats() [6]int64 {
	c.statsMu.Lock()
	defer c.statsMu.Unlock()
	t := c.statsDone
	for i, v := range c.statsCur {
		t[i] += v
	}
	return t
}

// observe counts, from a core subscription on _INBOX.>, the stream's PubAcks (and those that
// report a duplicate) and the deliveries to the durable consumer (and redeliveries).
func (c *chaos) observe(m *nats.Msg) {
	ackPrefix := "$JS.ACK." + streamName + "." + durableName + "."
	if rest, ok := strings.CutPrefix(m.Reply, ackPrefix); ok {
		c.deliveries.Add(1)
		if d, _, _ := strings.Cut(rest, "."); d != "1" {
			c.redeliveries.Add(1)
		}
		return
	}
	if !bytes.HasPrefix(m.Data, []byte(`{"stream":"`+streamName+`",`)) {
		return
	}
	var ack struct {
		Stream    string `json:"stream"`
		Seq       uint64 `json:"seq"`
		Duplicate bool   `json:"duplicate"`
	}
	if json.Unmarshal(m.Data, &ack) != nil || ack.Stream != streamName || ack.Seq == 0 {
		return
	}
	c.pubAcks.Add(1)
	if ack.Duplicate {
		c.dupAcks.Add(1)
	}
}

// inject injects one fault every 0.5–2 s until ctx ends (and every killed node is running
// again).
func (c *chaos) inject(ctx context.Context) {
	defer c.restarting.Wait()
	rnd := rand.New(rand.NewPCG(c.cfg.Seed, 3)) // a stream of its own per goroutine
	// Each kind of fault once, in random order, then at random: every run has them all.
	first := []int{0, 3, 6, 8, 9, 10, 11}
	if c.cfg.Cluster {
		first = []int{0, 3, 6, 7, 8, 9, 10, 11} // 6: kill the stream leader's node, 7: leader step-down
	}
	rnd.Shuffle(len(first), func(i, j int) { first[i], first[j] = first[j], first[i] })
	randomRelay := func() *proc { return c.relays[rnd.IntN(len(c.relays))] }
	for i := 0; ; i++ {
		if !sleepCtx(ctx, time.Duration(500+rnd.IntN(1500))*time.Millisecond) {
			return
		}
		x := rnd.IntN(12)
		if i < len(first) {
			x = first[i]
		}
		switch {
		case x < 3:
			// A frozen relay is left to wake: killing it would take away the case the
			// freeze is there for (a relay that wakes after its partitions were taken).
			retry(ctx, func() bool { r := randomRelay(); return !r.isFrozen() && r.kill() })
		case x < 6:
			retry(ctx, c.consumer.kill)
		case x < 8 && c.cfg.Cluster:
			if x == 6 && c.killLeader(ctx, time.Duration(500+rnd.IntN(3500))*time.Millisecond) {
				break
			}
			// A step-down (also instead of a kill while a killed node is down: two nodes
			// down would leave the streams without a quorum).
			retry(ctx, func() bool { return c.stepDown(ctx) })
		case x < 8:
			c.restartNATS(ctx, time.Duration(200+rnd.IntN(1300))*time.Millisecond)
		case x < 9:
			retry(ctx, func() bool {
				n := c.terminate(ctx, chaosRelayApp+"%", c.frozenLeaseApps()...)
				c.relayTerminated.Add(n)
				return n > 0
			})
		case x < 10:
			retry(ctx, func() bool { n := c.terminate(ctx, chaosConsumerApp); c.consumerTerminated.Add(n); return n > 0 })
		case x < 11:
			// A short freeze: under the lease interval (the first one always), or up to a
			// little under the fence delay; the relay keeps its partitions.
			d := time.Duration(50+rnd.IntN(150)) * time.Millisecond
			if i >= len(first) && rnd.IntN(2) == 0 {
				d = chaosLeaseInterval + time.Duration(rnd.Int64N(int64(chaosFenceDelay-chaosLeaseInterval-250*time.Millisecond)))
			}
			c.nextPublish(ctx, rnd)
			retry(ctx, func() bool { return c.freeze(ctx, randomRelay(), d) })
		default:
			// A long freeze, past the fence delay: the other relays end the frozen one's lease
			// session and take its partitions while it is frozen; it wakes with its lease expired.
			// The first one outlasts the streams' duplicate window too, so that anything it
			// sent on waking would be stored a second time.
			d := chaosFenceDelay + 750*time.Millisecond + time.Duration(rnd.Int64N(int64(4*time.Second)))
			if i < len(first) {
				d = chaosDuplicateWindow + time.Duration(500+rnd.IntN(1500))*time.Millisecond
			}
			c.nextPublish(ctx, rnd)
			// A relay that holds partitions: one still starting (just restarted after a
			// kill) has nothing for the others to take, which is not the case this is for.
			retry(ctx, func() bool { r := randomRelay(); return c.holdsPartitions(ctx, r) && c.freeze(ctx, r, d) })
		}
	}
}

// holdsPartitions reports whether relay p's current incarnation holds partition leases
// (advisory locks of its lease session, named "txoutbox-relay <relay id>").
func (c *chaos) holdsPartitions(ctx context.Context, p *proc) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var n int64
	err := c.pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.locktype = 'advisory' AND l.granted AND a.datname = current_database() AND a.application_name LIKE $1`,
		chaosRelayApp+" chaos-relay-"+strconv.Itoa(relayIndex(p))+"-%").Scan(&n)
	return err == nil && n > 0
}

// nextPublish waits, half of the times, for the next message a relay publishes to the stream
// (up to a second), so that the freeze that follows may catch a relay in the middle of a
// batch: between its publishes and their settle, or with later messages of a key waiting
// for a PubAck.
func (c *chaos) nextPublish(ctx context.Context, rnd *rand.Rand) {
	if rnd.IntN(2) == 0 {
		return
	}
	select {
	case <-c.published: // an old one
	default:
	}
	t := time.NewTimer(time.Second)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	case <-c.published:
	}
}

// freeze SIGSTOPs relay p for d (cut short when ctx ends: every relay runs at the end), then
// SIGCONTs it. It reports false when p could not be frozen (not running, frozen already).
func (c *chaos) freeze(ctx context.Context, p *proc, d time.Duration) bool {
	n, thaw := p.freeze()
	if thaw == nil {
		return false
	}
	frozenAt := time.Now()
	c.freezes.Add(1)
	id := relayID(relayIndex(p), n)
	c.frozenIDs.Store(id, true)
	c.frozenNow.Store(id, true)
	fmt.Fprintf(p.log, "[%s %d] chaos: SIGSTOP for %s\n", p.name, n, d.Round(time.Millisecond))
	c.restarting.Add(1)
	go func() {
		defer c.restarting.Done()
		sleepCtx(ctx, d)
		c.frozenNow.Delete(id)
		thaw()
		frozen := time.Since(frozenAt)
		fmt.Fprintf(p.log, "[%s %d] chaos: SIGCONT after %s\n", p.name, n, frozen.Round(time.Millisecond))
		switch {
		case frozen < chaosLeaseInterval:
			c.shortFreezes.Add(1)
		case frozen > chaosFenceDelay:
			c.longFreezes.Add(1)
		}
		for {
			longest := c.longestFreeze.Load()
			if int64(frozen) <= longest || c.longestFreeze.CompareAndSwap(longest, int64(frozen)) {
				break
			}
		}
	}()
	return true
}

// relayIndex is p's number among the relays (from 1).
func relayIndex(p *proc) int {
	i, _ := strconv.Atoi(strings.TrimPrefix(p.name, "relay-"))
	return i
}

// retry calls f until it reports that it did something (the process it kills may be between
// two incarnations), for up to two seconds.
func retry(ctx context.Context, f func() bool) {
	for range 40 {
		if f() || !sleepCtx(ctx, 50*time.Millisecond) {
			return
		}
	}
}

func (c *chaos) restartNATS(ctx context.Context, down time.Duration) {
	c.nats.Stop()
	sleepCtx(ctx, down)
	for {
		err := c.nats.Start()
		if err == nil {
			break
		}
		c.say("restart NATS: %v; trying again", err)
		if !sleepCtx(context.WithoutCancel(ctx), time.Second) {
			return
		}
	}
	c.natsRestarts.Add(1)
}

// createClusterStreams creates the streams with three replicas, asking again while the
// cluster's meta leader is settling, and waits until both have a leader.
func (c *chaos) createClusterStreams(ctx context.Context) error {
	deadline := time.Now().Add(time.Minute)
	for {
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := createStreamsReplicas(sctx, c.js, 3, chaosDuplicateWindow)
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return err
		}
		if !sleepCtx(ctx, 100*time.Millisecond) {
			return ctx.Err()
		}
	}
	for _, name := range []string{streamName, deadStreamName} {
		if _, err := c.cluster.WaitStreamLeader(name, nil, 30*time.Second); err != nil {
			return err
		}
	}
	return nil
}

// killLeader kills the node that leads the stream as SIGKILL would (its routes are cut
// first: it hands no leadership over) and starts it again with its store after down. It
// does nothing, and reports false, while a node killed before is not running again (two
// nodes down would leave no quorum), or when no replica is current enough to take over.
func (c *chaos) killLeader(ctx context.Context, down time.Duration) bool {
	if c.nodeDown.Load() {
		return false
	}
	// A node restarted a moment ago may still be catching up: kill only a leader whose
	// followers could replace it.
	if err := c.cluster.WaitStreamCurrent(streamName, 20*time.Second); err != nil {
		c.say("kill the stream leader: %v; a step-down instead", err)
		return false
	}
	leader := c.cluster.StreamLeader(streamName)
	if leader == nil {
		return false
	}
	c.nodeDown.Store(true)
	killed := time.Now()
	leader.Kill()
	c.leaderKills.Add(1)
	c.restarting.Add(2)
	go func() { // how long the stream has no leader: until a replica wins the election
		defer c.restarting.Done()
		for time.Since(killed) < 2*time.Minute {
			if c.cluster.StreamLeader(streamName) != nil {
				c.leaderlessMu.Lock()
				c.leaderless = append(c.leaderless, time.Since(killed))
				c.leaderlessMu.Unlock()
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	go func() {
		defer c.restarting.Done()
		sleepCtx(ctx, down) // cut short when the faults end: every node runs at the end
		for {
			err := leader.Start()
			if err == nil {
				break
			}
			c.say("restart NATS node %s: %v; trying again", leader.Name, err)
			if !sleepCtx(context.WithoutCancel(ctx), time.Second) {
				return
			}
		}
		c.nodeDown.Store(false)
	}()
	return true
}

// stepDown asks the stream's leader to step down and reports whether it did.
func (c *chaos) stepDown(ctx context.Context) bool {
	if c.cluster.StreamLeader(streamName) == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if embedded.StepDown(ctx, c.nc, streamName) != nil {
		return false
	}
	c.stepDowns.Add(1)
	return true
}

// frozenLeaseApps returns the application names of the lease sessions of the relays frozen
// now (relay run names them "txoutbox-relay <relay id>"): the backend terminations spare
// them, so that it is the other relays that end a frozen relay's lease session (the fence).
func (c *chaos) frozenLeaseApps() []string {
	var apps []string
	c.frozenNow.Range(func(id, _ any) bool {
		apps = append(apps, chaosRelayApp+" "+id.(string))
		return true
	})
	return apps
}

// terminate terminates the chaos database's backends whose application_name is like app,
// except those named in spare.
func (c *chaos) terminate(ctx context.Context, app string, spare ...string) int64 {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var n int64
	err := c.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE datname = current_database() AND application_name LIKE $1 AND application_name <> ALL ($2::text[])
		  AND pid <> pg_backend_pid()`, app, append([]string{}, spare...)).Scan(&n)
	if err != nil && ctx.Err() == nil {
		c.say("terminate backends %q: %v", app, err)
	}
	return n
}

func (c *chaos) produceOrders(ctx context.Context, target, poison int) error {
	rnd := rand.New(rand.NewPCG(c.cfg.Seed, 1)) // a stream of its own per goroutine
	step := max(target/poison, 1)
	interval := time.Duration(float64(c.cfg.ProduceFor) * (1 - chaosRollback) / float64(target))
	next := time.Now()
	committed, poisoned := 0, 0
	for id := int64(1); committed < target; id++ {
		fate := orderNormal
		switch {
		case poisoned < poison && committed%step == step/2:
			fate = orderPoison
		case rnd.Float64() < chaosRollback:
			fate = orderRollback
		}
		if err := c.prod.order(ctx, rnd, id, fate); err != nil {
			return err
		}
		switch fate {
		case orderPoison:
			poisoned++
			committed++
		case orderNormal:
			committed++
		}
		next = next.Add(interval)
		if err := sleepUntil(ctx, next); err != nil {
			return err
		}
	}
	return nil
}

func (c *chaos) producePayments(ctx context.Context, target int) error {
	rnd := rand.New(rand.NewPCG(c.cfg.Seed, 2)) // a stream of its own per goroutine
	interval := time.Duration(float64(c.cfg.ProduceFor) * 0.8 / float64(max(target, 1)))
	next := time.Now()
	for id := int64(1); c.prod.charged.Load() < int64(target); id++ {
		fate := fateCommit
		switch x := rnd.Float64(); {
		case id <= 4: // every fate at least once
			fate = []string{fateDieBeforeCharge, fateDieAfterCharge, fateDecline, fateCommit}[id-1]
		case x < 0.075:
			fate = fateDieBeforeCharge
		case x < 0.15:
			fate = fateDieAfterCharge
		case x < 0.25:
			fate = fateDecline
		}
		if err := c.prod.payment(ctx, rnd, id, fate); err != nil {
			return err
		}
		next = next.Add(interval)
		if err := sleepUntil(ctx, next); err != nil {
			return err
		}
	}
	return nil
}

func (c *chaos) progress(ctx context.Context, started time.Time) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second) // NATS may be restarting
	defer cancel()
	var effects, open int64
	_ = c.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM demo_effects),
		(SELECT count(*) FROM txoutbox_messages WHERE state IN ('ready', 'prepared', 'check_exhausted'))`).Scan(&effects, &open)
	pending, unacked := "?", "?"
	if cons, err := c.js.Consumer(ctx, streamName, durableName); err == nil {
		if info, err := cons.Info(ctx); err == nil {
			pending, unacked = strconv.FormatUint(info.NumPending, 10), strconv.Itoa(info.NumAckPending)
		}
	}
	p := c.prod
	st := c.consumerStats()
	natsFaults := fmt.Sprintf("NATS restarts %d", c.natsRestarts.Load())
	if c.cfg.Cluster {
		natsFaults = fmt.Sprintf("leader kills %d, step-downs %d", c.leaderKills.Load(), c.stepDowns.Load())
	}
	var relayKills, relaySelfKills int64
	for _, r := range c.relays {
		relayKills += r.kills.Load()
		relaySelfKills += r.selfKills.Load()
	}
	c.say("  [%4.0fs] committed: %d orders, %d payments · outbox open %d · consumer pending %s, unacked %s · effects %d · relay kills %d + %d at before-settle · relay freezes %d, fenced %d · consumer kills %d + %d after commit · %s · backends terminated %d · dup PubAcks %d · dedup duplicates ≥ %d",
		time.Since(started).Seconds(), p.ordersCommitted.Load()+p.ordersPoisoned.Load(), p.charged.Load(), open, pending, unacked, effects,
		relayKills, relaySelfKills, c.freezes.Load(), c.fences.Load(), c.consumer.kills.Load(), c.consumer.selfKills.Load(),
		natsFaults, c.relayTerminated.Load()+c.consumerTerminated.Load(), c.dupAcks.Load(), st[1])
}

func (c *chaos) result(t *Tally) *ChaosResult {
	st := c.consumerStats()
	r := &ChaosResult{
		Tally:                      t,
		Messages:                   t.Orders + t.Poisoned + t.Charged,
		Relays:                     len(c.relays),
		RelayFreezes:               c.freezes.Load(),
		ShortFreezes:               c.shortFreezes.Load(),
		LongFreezes:                c.longFreezes.Load(),
		LongestFreeze:              time.Duration(c.longestFreeze.Load()),
		Fences:                     c.fences.Load(),
		OtherFences:                c.otherFences.Load(),
		WithheldBatches:            c.withheld.Load(),
		LeaseInterval:              chaosLeaseInterval,
		FenceDelay:                 chaosFenceDelay,
		DuplicateWindow:            chaosDuplicateWindow,
		ConsumerStarts:             c.consumer.starts.Load(),
		ConsumerKills:              c.consumer.kills.Load(),
		ConsumerFaultKills:         c.consumer.hits(fault.ConsumerAfterCommit),
		ConsumerOtherExits:         c.consumer.otherExits.Load(),
		NATSRestarts:               c.natsRestarts.Load(),
		LeaderKills:                c.leaderKills.Load(),
		StepDowns:                  c.stepDowns.Load(),
		Leaderless:                 c.leaderlessTimes(),
		RelayBackendsTerminated:    c.relayTerminated.Load(),
		ConsumerBackendsTerminated: c.consumerTerminated.Load(),
		PubAcks:                    c.pubAcks.Load(),
		DuplicatePubAcks:           c.dupAcks.Load(),
		Deliveries:                 c.deliveries.Load(),
		Redeliveries:               c.redeliveries.Load(),
		ConsumerProcessed:          st[0],
		ConsumerDuplicates:         st[1],
	}
	for _, p := range c.relays {
		r.RelayStarts += p.starts.Load()
		r.RelayKills += p.kills.Load()
		r.RelayFaultKills += p.hits(fault.RelayBeforeSettle)
		r.RelayOtherExits += p.otherExits.Load()
	}
	return r
}

func (c *chaos) report(r *ChaosResult) {
	t := r.Tally
	line := func(label, format string, args ...any) {
		c.say("  %-44s %s", label, fmt.Sprintf(format, args...))
	}
	c.say("")
	c.say("Chaos proof (seed %d)", c.cfg.Seed)
	line("messages through the whole chain", "%d = %d orders + %d poisoned orders + %d payments", r.Messages, t.Orders, t.Poisoned, t.Charged)
	line("producer transactions rolled back", "%d orders; payments: %d declined, %d never charged", t.RolledBackOrders, t.Declined, t.PaymentsByFate[fateDieBeforeCharge])
	line("half messages settled by the check-back", "%d committed, %d rolled back (checker: %d COMMIT, %d ROLLBACK, %d UNKNOWN)",
		t.HalfCommittedByCheckback, t.HalfRolledBackByCheckback, c.chk.commit.Load(), c.chk.rollback.Load(), c.chk.unknown.Load())
	line("relay processes SIGKILLed", "%d at random moments + %d by their fault point between publish and settle (%d relays sharing the partitions, %d starts, %d other exits)",
		r.RelayKills, r.RelayFaultKills, r.Relays, r.RelayStarts, r.RelayOtherExits)
	line("relay processes frozen (SIGSTOP, SIGCONT)", "%d: %d shorter than the lease interval (%s), %d past the fence delay (%s), longest %.1fs (duplicate window %.1fs)",
		r.RelayFreezes, r.ShortFreezes, r.LeaseInterval, r.LongFreezes, r.FenceDelay, r.LongestFreeze.Seconds(), r.DuplicateWindow.Seconds())
	line("frozen relays' partitions taken over", "%d fences of a frozen relay's lease session (%d of relays never frozen); %d batches cut short on waking with an expired lease",
		r.Fences, r.OtherFences, r.WithheldBatches)
	line("consumer processes SIGKILLed", "%d at random moments + %d by their fault point between commit and ack (%d starts, %d other exits)",
		r.ConsumerKills, r.ConsumerFaultKills, r.ConsumerStarts, r.ConsumerOtherExits)
	if c.cfg.Cluster {
		line("stream leader's node killed (like SIGKILL)", "%d, restarted with its store 0.5–4 s later; leaderless after a kill: %s", r.LeaderKills, durationSpread(r.Leaderless))
		line("stream leader step-downs", "%d", r.StepDowns)
	} else {
		line("NATS server restarts", "%d", r.NATSRestarts)
	}
	line("PostgreSQL backends terminated", "%d of the relay, %d of the consumer", r.RelayBackendsTerminated, r.ConsumerBackendsTerminated)
	line("duplicates absorbed by JetStream", "%d duplicate PubAcks of %d (republishes inside the duplicate window; seen on the wire)", r.DuplicatePubAcks, r.PubAcks)
	line("duplicates absorbed by the dedup table", "%d or more (counted by the consumer processes)", r.ConsumerDuplicates)
	line("deliveries to the consumer", "%d, %d of them redeliveries (seen on the wire)", r.Deliveries, r.Redeliveries)
	line("stream", "%d messages, %d distinct message ids; dead letters %d (%d distinct)", t.StreamMsgs, t.StreamDistinctIDs, t.DeadLetters, t.DeadDistinct)
	line("effects applied (ledger rows)", "%d = %d orders + %d payments", t.Effects, t.OrderEffects, t.PaymentEffects)
	c.say("")
	printInvariants(c.out, t)
}

func (c *chaos) leaderlessTimes() []time.Duration {
	c.leaderlessMu.Lock()
	defer c.leaderlessMu.Unlock()
	return slices.Clone(c.leaderless)
}

// durationSpread describes ds as "p50 X, max Y (n)".
func durationSpread(ds []time.Duration) string {
	if len(ds) == 0 {
		return "none measured"
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return fmt.Sprintf("p50 %.1fs, max %.1fs (%d elections)", s[(len(s)-1)/2].Seconds(), s[len(s)-1].Seconds(), len(s))
}

// withDatabase returns dsn pointing at database db.
func withDatabase(dsn, db string) (string, error) {
	if strings.Contains(dsn, "://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return "", fmt.Errorf("invalid DATABASE_URL: %w", err)
		}
		u.Path = "/" + db
		return u.String(), nil
	}
	return dsn + " dbname=" + db, nil
}

// goTool is the go command that builds the relay: the one on PATH, else the one in the bin
// directory of $GOROOT.
func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	if root := os.Getenv("GOROOT"); root != "" {
		return filepath.Join(root, "bin", "go")
	}
	return "go"
}
