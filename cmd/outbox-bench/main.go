// Command outbox-bench runs txoutbox's shared yardstick (README, "Performance"):
// `outbox-bench drain|latency|idle|consume|scheduled|soak|history` against DATABASE_URL and
// NATS_URL, or embedded services when they are unset (`drain --relays 1,2,3` measures the
// scale-out over several relay processes). Each scenario checks that nothing was lost or
// duplicated, exits non-zero if something was, and prints one final line of key=value pairs.
// Run `outbox-bench --help` for the scenarios and their flags.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/txoutbox/txoutbox/internal/bench"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := bench.Main(ctx, os.Args[1:], nil)
	stop()
	os.Exit(code)
}
