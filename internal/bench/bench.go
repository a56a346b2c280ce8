// Package bench implements outbox-bench, txoutbox's shared yardstick (README, "Performance"):
// scenarios that measure the producer, the relay and the broker's own ceiling on real
// services, check that nothing was lost or duplicated, and print one final line of key=value
// pairs so that runs can be compared.
//
// cmd/outbox-bench/main.go only calls Main. Each scenario lives in its own file and registers
// itself with register in an init function.
package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"sort"
	"strings"
)

// Env is the process environment the command runs in; tests substitute their own.
type Env struct {
	Stdout io.Writer // the final result line
	Stderr io.Writer // progress
	Getenv func(string) string
	// Exe is the binary re-executed for child processes (the relay of `idle`, an embedded
	// nats-server). Defaults to os.Executable().
	Exe string
	// ExeEnv is added to the environment of those child processes (tests use it to make a
	// test binary behave as outbox-bench).
	ExeEnv []string
}

// scenario is one subcommand.
type scenario struct {
	name    string
	summary string
	hidden  bool // internal modes (child processes)
	// flags defines the scenario's own flags on fs and returns the function that runs it.
	flags func(fs *flag.FlagSet) func(ctx context.Context, r *run) error
}

var scenarios = map[string]scenario{}

func register(s scenario) { scenarios[s.name] = s }

// Exit statuses.
const (
	ExitOK     = 0
	ExitFailed = 1 // an error, or the check found lost or duplicated messages
	ExitUsage  = 2 // bad usage, or a scenario that cannot run yet
)

// ErrCheckFailed marks a run whose result check found lost, duplicated, corrupted or
// misordered messages; the final line is still printed.
var ErrCheckFailed = errors.New("check failed")

// errUsage marks usage errors (exit status 2).
var errUsage = errors.New("usage")

// ErrNotWired marks a scenario that cannot run yet (exit status 2); its message is printed
// as it is.
var ErrNotWired = errors.New("not wired")

const usage = `outbox-bench: txoutbox's shared yardstick (README, "Performance").

Usage:
  outbox-bench <scenario> [flags]

Scenarios:
%s
Services: PostgreSQL at DATABASE_URL, else 127.0.0.1:5432 (user postgres, database test) if it
answers, else a throwaway cluster with fsync on; NATS at NATS_URL, else an embedded nats-server
with JetStream in a child process. Each scenario uses a fresh schema and its own streams on
bench.>, checks that nothing was lost or duplicated (exit status 1 if something was) and prints
progress on stderr and one final line of key=value pairs on stdout.
Every scenario takes --help.
`

// Main runs the command with args (without the program name) and returns the exit status.
func Main(ctx context.Context, args []string, env *Env) int {
	if env == nil {
		env = &Env{}
	}
	if env.Stdout == nil {
		env.Stdout = os.Stdout
	}
	if env.Stderr == nil {
		env.Stderr = os.Stderr
	}
	if env.Getenv == nil {
		env.Getenv = os.Getenv
	}
	if env.Exe == "" {
		if exe, err := os.Executable(); err == nil {
			env.Exe = exe
		}
	}
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		printUsage(env.Stdout)
		if len(args) == 0 {
			return ExitUsage
		}
		return ExitOK
	}
	sc, ok := scenarios[args[0]]
	if !ok {
		fmt.Fprintf(env.Stderr, "outbox-bench: unknown scenario %q\n\n", args[0])
		printUsage(env.Stderr)
		return ExitUsage
	}
	fs := flag.NewFlagSet(sc.name, flag.ContinueOnError)
	fs.SetOutput(env.Stderr)
	r := &run{env: env, name: sc.name}
	fs.BoolVar(&r.noWriteFence, "no-write-fence", false, "connect the relays to NATS without the write fence that relay run dials through (relay.WriteFence; on by default, as deployed), to measure what it costs")
	if !sc.hidden {
		fs.BoolVar(&r.keep, "keep", false, "keep the schema and streams after the run (for inspection)")
		fs.BoolVar(&r.natsInProcess, "nats-in-process", false, "without NATS_URL, run the embedded nats-server in this process instead of a child process")
		fs.BoolVar(&r.natsCluster, "nats-cluster", false, "without NATS_URL, run a three-node embedded JetStream cluster on loopback instead of one server, and give the streams three replicas (R3)")
	}
	fs.Usage = func() {
		fmt.Fprintf(env.Stderr, "outbox-bench %s: %s\n\nFlags:\n", sc.name, sc.summary)
		fs.PrintDefaults()
	}
	fn := sc.flags(fs)
	if err := fs.Parse(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return ExitOK
		}
		return ExitUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(env.Stderr, "outbox-bench %s: unexpected arguments %q\n", sc.name, fs.Args())
		return ExitUsage
	}
	defer r.close()
	err := fn(ctx, r)
	switch {
	case err == nil:
		return ExitOK
	case errors.Is(err, ErrNotWired):
		fmt.Fprintln(env.Stderr, err)
		return ExitUsage
	case errors.Is(err, errUsage):
		fmt.Fprintf(env.Stderr, "outbox-bench %s: %v\n", sc.name, err)
		return ExitUsage
	case errors.Is(err, ErrCheckFailed):
		fmt.Fprintf(env.Stderr, "outbox-bench %s: FAILED: %v\n", sc.name, err)
		return ExitFailed
	default:
		fmt.Fprintf(env.Stderr, "outbox-bench %s: %v\n", sc.name, err)
		return ExitFailed
	}
}

func printUsage(w io.Writer) {
	var names []string
	for n, s := range scenarios {
		if !s.hidden {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	var b strings.Builder
	for _, n := range names {
		fmt.Fprintf(&b, "  %-10s %s\n", n, scenarios[n].summary)
	}
	fmt.Fprintf(w, usage, b.String())
}

func usageErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errUsage, fmt.Sprintf(format, args...))
}

// startProfile starts a CPU profile of this process into path, or does nothing when path is
// "". The returned function stops it (once, later calls do nothing) and returns the path
// written ("" when none).
func startProfile(path string) (func() string, error) {
	if path == "" {
		return func() string { return "" }, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	stopped := false
	return func() string {
		if stopped {
			return ""
		}
		stopped = true
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			return ""
		}
		return path
	}, nil
}
