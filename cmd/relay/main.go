// Command relay publishes txoutbox outbox rows to NATS JetStream and administers the outbox.
// Run `relay --help` for the commands and `relay <command> --help` for their settings.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/txoutbox/txoutbox/internal/relaycli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := relaycli.Main(ctx, os.Args[1:], nil)
	stop()
	os.Exit(code)
}
