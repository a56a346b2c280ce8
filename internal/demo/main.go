// Package demo is the producer demo (`go run ./cmd/producer-demo`): the whole txoutbox chain
// on one machine, with faults injected, ending in a summary and a check of every invariant
// from the database. With -chaos it runs the chaos proof instead: the relay and the consumer
// as separate processes, killed and cut off at random while thousands of messages go through.
//
// With no DATABASE_URL it starts a throwaway cluster from the local PostgreSQL binaries
// (removed at exit, also on Ctrl-C; kept running with -keep), and never writes into a
// PostgreSQL that merely happens to run on this machine; with no NATS_URL it starts an
// embedded nats-server with JetStream in a temporary directory.
package demo

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/txoutbox/txoutbox/internal/fault"
)

const usage = `producer-demo: the whole txoutbox chain on this machine, with faults injected.

  producer → outbox (PostgreSQL) → relay → JetStream → idempotent consumer, plus half messages
  settled by the check-back. It ends with a summary and a check of every invariant; the exit
  status is 1 if one did not hold.

Usage:
  go run ./cmd/producer-demo [flags]            # the demo (about 15 seconds)
  go run ./cmd/producer-demo -chaos [flags]     # the chaos proof (separate processes, SIGKILLs)
  go run ./cmd/producer-demo -chaos -cluster    # the chaos proof on a three-node JetStream cluster

Services: DATABASE_URL, else a throwaway cluster from the local PostgreSQL binaries (never a
PostgreSQL that merely runs here: nobody named it); NATS_URL, else an embedded nats-server
with JetStream (the chaos proof always embeds NATS: it restarts it, or with -cluster kills and
restarts its nodes).

Flags:
`

// hidden flags: the consumer role the chaos run starts as a child process.
var hidden = map[string]bool{"role": true, "schema": true, "app-name": true, "batch": true, "ack-wait": true, "fault": true, "stats-every": true}

// Main runs the demo command with args (without the program name) and returns the exit
// status: 0 when every invariant held, 1 when one did not or the run failed, 2 on bad usage,
// 130 when interrupted.
func Main(args []string, stdout, stderr io.Writer) int {
	sigCtx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-sigCtx.Done()
		stop() // a second Ctrl-C kills at once
	}()
	// A closed stdout (| head) must not kill the process before it cleans up: with SIGPIPE
	// notified, writes fail instead, and the first failed write stops the run.
	ctx, cancel := context.WithCancel(sigCtx)
	defer cancel()
	sigpipe := make(chan os.Signal, 1)
	signal.Notify(sigpipe, syscall.SIGPIPE)
	defer signal.Stop(sigpipe)
	go func() {
		for range sigpipe { // broken sockets raise it too; only a failed write to out matters
		}
	}()
	stdout = &cancelOnError{w: stdout, cancel: cancel}

	cfg := DefaultConfig()
	cc := ChaosConfig{}
	var role consumerRole
	var roleName string
	var chaos bool
	fs := flag.NewFlagSet("producer-demo", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&cfg.DSN, "database-url", "", "PostgreSQL URL (env DATABASE_URL; default: a throwaway cluster)")
	fs.StringVar(&cfg.NATSURL, "nats-url", "", "NATS URL (env NATS_URL; default: an embedded nats-server)")
	fs.IntVar(&cfg.Orders, "orders", cfg.Orders, "orders to create")
	fs.IntVar(&cfg.Payments, "payments", cfg.Payments, "payments to capture with half messages")
	fs.Float64Var(&cfg.Rate, "rate", cfg.Rate, "orders per second")
	fs.Float64Var(&cfg.Rollback, "rollback", cfg.Rollback, "fraction of order transactions rolled back by the producer")
	fs.IntVar(&cfg.Poison, "poison", cfg.Poison, "poisoned orders (the consumer always fails: dead letters)")
	fs.Float64Var(&cfg.LoseAcks, "lose-acks", cfg.LoseAcks, "fraction of the relay's PubAcks lost on the wire")
	fs.Float64Var(&cfg.ConsumerCrash, "consumer-crash", cfg.ConsumerCrash, "probability, per consumer commit, of a crash before the ack")
	fs.Float64Var(&cfg.Duplicates, "duplicates", cfg.Duplicates, "fraction of order events enqueued twice (duplicate publishes)")
	fs.Float64Var(&cfg.PaymentDie, "payment-die", cfg.PaymentDie, "fraction of payment producers that die before settling")
	fs.Float64Var(&cfg.Decline, "decline", cfg.Decline, "fraction of payments the provider declines")
	fs.DurationVar(&cfg.Timeout, "timeout", cfg.Timeout, "give up after this long")
	fs.BoolVar(&cfg.Keep, "keep", false, "keep the demo schema (or the chaos database) to look around")
	fs.BoolVar(&cfg.Verbose, "v", false, "show the components' own logs")
	fs.Uint64Var(&cfg.Seed, "seed", 0, "random seed (0: pick one)")
	fs.StringVar(&cfg.MetricsAddr, "metrics-addr", "", "serve /metrics (every component), /healthz, /readyz and the status page on this address, e.g. 127.0.0.1:9090 (default off)")
	fs.DurationVar(&cfg.Linger, "linger", 0, "with -metrics-addr: keep serving this long after the summary (Ctrl-C stops)")
	fs.BoolVar(&chaos, "chaos", false, "run the chaos proof instead of the demo")
	fs.IntVar(&cc.Messages, "messages", DefaultChaosMessages, "chaos: messages to send (at least)")
	fs.DurationVar(&cc.ProduceFor, "produce-for", 0, "chaos: spread the messages over this long (default: messages/100 per second, at least 20s)")
	fs.StringVar(&cc.RelayBin, "relay-bin", "", "chaos: the relay binary (default: go build ./cmd/relay)")
	fs.IntVar(&cc.Relays, "relays", chaosRelays, "chaos: relay processes sharing the partitions (at least 2: a frozen relay's partitions are taken by another)")
	fs.BoolVar(&cc.Cluster, "cluster", false, "chaos: a three-node JetStream cluster with R3 streams, whose stream leader is killed and stepped down")
	// The consumer role (hidden).
	fs.StringVar(&roleName, "role", "", "")
	fs.StringVar(&role.Schema, "schema", "", "")
	fs.StringVar(&role.AppName, "app-name", "txoutbox-chaos-consumer", "")
	fs.IntVar(&role.BatchSize, "batch", 1, "")
	fs.DurationVar(&role.AckWait, "ack-wait", 2*time.Second, "")
	if fault.Enabled { // only in binaries built with -tags txoutbox_fault, as the relay's --fault
		fs.StringVar(&role.Faults, "fault", "", "")
	}
	fs.DurationVar(&role.StatsEvery, "stats-every", 100*time.Millisecond, "")

	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(fs, stdout)
			return 0
		}
		fmt.Fprintf(stderr, "producer-demo: %v (see -help)\n", err)
		return 2
	}
	if cfg.DSN == "" {
		cfg.DSN = os.Getenv("DATABASE_URL")
	}
	if cfg.NATSURL == "" {
		cfg.NATSURL = os.Getenv("NATS_URL")
	}
	if fault.Enabled && role.Faults == "" { // a production build ignores it, as the relay does
		role.Faults = os.Getenv(fault.EnvVar)
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "producer-demo: unexpected arguments %q\n", fs.Args())
		return 2
	}
	switch roleName {
	case "":
	case "consumer":
		role.DSN, role.NATSURL = cfg.DSN, cfg.NATSURL
		if role.DSN == "" || role.NATSURL == "" || role.Schema == "" {
			fmt.Fprintln(stderr, "producer-demo: the consumer role needs -database-url, -nats-url and -schema")
			return 2
		}
		return runConsumerRole(ctx, role, stdout, stderr)
	default:
		fmt.Fprintf(stderr, "producer-demo: unknown role %q\n", roleName)
		return 2
	}

	if cc.Cluster && !chaos {
		fmt.Fprintln(stderr, "producer-demo: -cluster is for -chaos")
		return 2
	}
	if chaos && cc.Relays < 2 {
		fmt.Fprintf(stderr, "producer-demo: -relays %d: want at least 2 (a frozen relay's partitions are taken by another)\n", cc.Relays)
		return 2
	}
	if chaos {
		if cfg.MetricsAddr != "" || cfg.Linger != 0 {
			fmt.Fprintln(stderr, "producer-demo: -metrics-addr and -linger are for the demo, not -chaos")
			return 2
		}
		cc.DSN, cc.Seed, cc.Keep, cc.Out = cfg.DSN, cfg.Seed, cfg.Keep, stdout
		self, err := os.Executable()
		if err != nil {
			fmt.Fprintf(stderr, "producer-demo: %v\n", err)
			return 1
		}
		if fault.Enabled {
			cc.ConsumerExe = self // it can arm the consumer's fault point
		} // else RunChaos builds one that can, as it builds the relay
		res, err := RunChaos(ctx, cc)
		return exitStatus(ctx, stderr, res != nil && res.Tally.OK(), err)
	}
	if err := cfg.validate(); err != nil {
		fmt.Fprintf(stderr, "producer-demo: %v\n", err)
		return 2
	}
	res, err := Run(ctx, cfg, stdout)
	if res != nil && err == nil && cfg.Linger > 0 {
		ctx = context.WithoutCancel(ctx) // Ctrl-C ended the linger, not the run
	}
	return exitStatus(ctx, stderr, res != nil && res.OK(), err)
}

func exitStatus(ctx context.Context, stderr io.Writer, ok bool, err error) int {
	switch {
	case ctx.Err() != nil:
		fmt.Fprintln(stderr, "producer-demo: interrupted; cleaned up")
		return 130
	case err != nil:
		fmt.Fprintf(stderr, "producer-demo: %v\n", err)
		return 1
	case !ok:
		return 1
	}
	return 0
}

func (c *Config) validate() error {
	frac := map[string]float64{"rollback": c.Rollback, "lose-acks": c.LoseAcks, "consumer-crash": c.ConsumerCrash,
		"duplicates": c.Duplicates, "payment-die": c.PaymentDie, "decline": c.Decline}
	for name, v := range frac {
		if v < 0 || v > 0.5 {
			return fmt.Errorf("-%s must be between 0 and 0.5, got %v", name, v)
		}
	}
	switch {
	case c.Orders < 1:
		return fmt.Errorf("-orders must be at least 1")
	case c.Payments < 0:
		return fmt.Errorf("-payments must not be negative")
	case c.Poison < 0 || c.Poison > c.Orders:
		return fmt.Errorf("-poison must be between 0 and -orders")
	case c.Rate <= 0:
		return fmt.Errorf("-rate must be positive")
	case c.Rollback+c.Duplicates > 0.9 || c.PaymentDie+c.Decline > 0.9:
		return fmt.Errorf("the fault fractions leave too few healthy messages")
	case c.Timeout <= 0:
		return fmt.Errorf("-timeout must be positive")
	case c.Linger < 0:
		return fmt.Errorf("-linger must not be negative")
	case c.Linger > 0 && c.MetricsAddr == "":
		return fmt.Errorf("-linger keeps the metrics listener serving: it needs -metrics-addr")
	}
	if c.MetricsAddr != "" {
		if _, _, err := net.SplitHostPort(c.MetricsAddr); err != nil {
			return fmt.Errorf("invalid -metrics-addr %q: %w", c.MetricsAddr, err)
		}
	}
	return nil
}

func printUsage(fs *flag.FlagSet, w io.Writer) {
	fmt.Fprint(w, usage)
	fs.VisitAll(func(f *flag.Flag) {
		if hidden[f.Name] {
			return
		}
		kind, text := flag.UnquoteUsage(f)
		left := "-" + f.Name
		if kind != "" {
			left += " " + kind
		}
		def := ""
		if f.DefValue != "" && f.DefValue != "0" && f.DefValue != "0s" && f.DefValue != "false" && !strings.Contains(text, "default") {
			def = " (default " + f.DefValue + ")"
		}
		fmt.Fprintf(w, "  %-22s %s%s\n", left, text, def)
	})
}

// cancelOnError cancels the run when a write to the output fails (a closed pipe).
type cancelOnError struct {
	w      io.Writer
	cancel context.CancelFunc
}

func (c *cancelOnError) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	if err != nil {
		c.cancel()
	}
	return n, err
}
