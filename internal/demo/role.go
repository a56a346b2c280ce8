package demo

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/internal/fault"
)

// consumerRole is the hidden role the chaos run starts as a separate OS process: the
// inventory/points consumer in ordered mode (consumer.Config.Ordered: per key, effects are
// applied in stream order across its kills), with its fault point armed, reporting its
// counters on stdout.
type consumerRole struct {
	DSN, NATSURL, Schema, AppName string
	BatchSize                     int
	AckWait                       time.Duration
	Faults                        string
	StatsEvery                    time.Duration
}

// statsPrefix starts the counter lines the consumer role prints.
const statsPrefix = "stats "

func runConsumerRole(ctx context.Context, o consumerRole, stdout, stderr io.Writer) int {
	// The consumer's crash point (fault.ConsumerAfterCommit) is the demo's own: a database
	// handle that kills the process after a commit, before the ack (see crashAfterCommit).
	points, err := fault.ParseSpec(o.Faults)
	if err != nil {
		fmt.Fprintf(stderr, "consumer: %v\n", err)
		return 2
	}
	for name := range points {
		if name != fault.ConsumerAfterCommit {
			fmt.Fprintf(stderr, "consumer: fault point %s is not the consumer's\n", name)
			return 2
		}
		// Armed like the relay's point: only a binary built with the txoutbox_fault tag can
		// (Arm returns fault.ErrNotCompiled otherwise); the point fires with its probability.
		if err := fault.Arm(name, points[name], nil); err != nil {
			fmt.Fprintf(stderr, "consumer: %v\n", err)
			return 2
		}
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	pool, err := newPool(ctx, o.DSN, o.Schema, o.AppName, 8)
	if err != nil {
		fmt.Fprintf(stderr, "consumer: %v\n", err)
		return 1
	}
	defer pool.Close()
	nc, err := connectNATS(o.NATSURL, o.AppName)
	if err != nil {
		fmt.Fprintf(stderr, "consumer: connect to NATS: %v\n", err)
		return 1
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		fmt.Fprintf(stderr, "consumer: %v\n", err)
		return 1
	}
	inv := &inventory{poisonPermanent: true}
	var db txoutbox.Beginner = pool
	if points[fault.ConsumerAfterCommit] > 0 {
		db = &crashAfterCommit{db: pool, p: 1, crash: func() { fault.Point(fault.ConsumerAfterCommit) }}
	}
	c, err := consumer.New(db, js, inv.handle, &consumer.Config{
		Stream: streamName, Durable: durableName, Schema: o.Schema, Concurrency: 4, BatchSize: max(o.BatchSize, 1),
		// Kills inflate delivery counts; poisoned messages are dead-lettered at once (Permanent),
		// so a generous limit only keeps unlucky healthy messages out of the dead letters.
		MaxDeliveries: 1000, BackoffBase: 100 * time.Millisecond, BackoffMax: time.Second,
		AckWait: o.AckWait, Logger: log, Ordered: true,
	})
	if err != nil {
		fmt.Fprintf(stderr, "consumer: %v\n", err)
		return 2
	}
	report := func() {
		st := statsOf(c.Stats())
		fmt.Fprintf(stdout, "%sprocessed=%d duplicates=%d retries=%d dead=%d unavailable=%d ackfail=%d\n",
			statsPrefix, st[0], st[1], st[2], st[3], st[4], st[5])
	}
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(o.StatsEvery)
		defer t.Stop()
		var last [6]int64
		for {
			select {
			case <-done:
				return
			case <-t.C:
				if st := statsOf(c.Stats()); st != last {
					last = st
					report()
				}
			}
		}
	}()
	err = c.Run(ctx)
	close(done)
	report()
	if err != nil {
		fmt.Fprintf(stderr, "consumer: %v\n", err)
		return 1
	}
	return 0
}

// parseStats reads a line printed by the consumer role.
func parseStats(line string) ([6]int64, bool) {
	var s [6]int64
	if _, err := fmt.Sscanf(line, statsPrefix+"processed=%d duplicates=%d retries=%d dead=%d unavailable=%d ackfail=%d",
		&s[0], &s[1], &s[2], &s[3], &s[4], &s[5]); err != nil {
		return s, false
	}
	return s, true
}
