package bench

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/relay"
)

// Internal modes: the binary re-executes itself as these child processes.
const (
	natsServerMode = "_nats-server"
	relayMode      = "_relay"
)

func init() {
	register(scenario{name: natsServerMode, hidden: true, summary: "internal: an embedded nats-server", flags: natsServerFlags})
	register(scenario{name: relayMode, hidden: true, summary: "internal: the relay as a process of its own", flags: relayFlags})
}

// untilStdinCloses returns a context cancelled when ctx is or when stdin reaches EOF (the
// parent closed it, or died).
func untilStdinCloses(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	return ctx, cancel
}

func natsServerFlags(fs *flag.FlagSet) func(context.Context, *run) error {
	cluster := fs.Bool("cluster", false, "a three-node cluster")
	return func(ctx context.Context, r *run) error {
		if *cluster {
			c, err := embedded.StartCluster(embedded.ClusterOptions{})
			if err != nil {
				return err
			}
			defer c.Shutdown()
			fmt.Fprintf(r.env.Stdout, "nats-url %s\n", c.URLs())
			ctx, cancel := untilStdinCloses(ctx)
			defer cancel()
			<-ctx.Done()
			return nil
		}
		srv, err := embedded.StartNATS(embedded.NATSOptions{})
		if err != nil {
			return err
		}
		defer srv.Shutdown()
		fmt.Fprintf(r.env.Stdout, "nats-url %s\n", srv.URL())
		ctx, cancel := untilStdinCloses(ctx)
		defer cancel()
		<-ctx.Done()
		return nil
	}
}

func relayFlags(fs *flag.FlagSet) func(context.Context, *run) error {
	schema := fs.String("schema", "", "outbox schema")
	subjects := fs.String("subjects", "", "comma-separated subjects")
	return func(ctx context.Context, r *run) error {
		ctx, cancel := untilStdinCloses(ctx)
		defer cancel()
		dsn, url := r.env.Getenv("DATABASE_URL"), r.env.Getenv("NATS_URL")
		if dsn == "" || url == "" {
			return usageErr("%s needs DATABASE_URL and NATS_URL", relayMode)
		}
		pool, err := pgxpool.New(ctx, dsn)
		if err != nil {
			return err
		}
		defer pool.Close()
		nc, err := nats.Connect(url, nats.Name("outbox-bench relay"), nats.MaxReconnects(-1))
		if err != nil {
			return err
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		rl, err := relay.New(pool, js, &relay.Config{
			Schema:   *schema,
			Subjects: strings.Split(*subjects, ","),
			Logger:   relayLogger(r.env.Stderr),
		})
		if err != nil {
			return err
		}
		fmt.Fprintf(r.env.Stdout, "ready pid=%d\n", os.Getpid())
		return rl.Run(ctx)
	}
}

// relayLogger logs the relay's warnings and errors only: progress lines are the bench's.
func relayLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
