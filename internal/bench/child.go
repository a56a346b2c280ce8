package bench

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
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
	metricsAddr := fs.String("metrics-addr", "", "serve the relay's Prometheus metrics on this address (host:port; port 0 picks one); the ready line names it")
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
		cfg := &relay.Config{
			Schema:   *schema,
			Subjects: strings.Split(*subjects, ","),
			Logger:   relayLogger(r.env.Stderr),
		}
		var metricsURL string
		if *metricsAddr != "" {
			reg := prometheus.NewRegistry()
			cfg.Registerer = reg
			ln, err := net.Listen("tcp", *metricsAddr)
			if err != nil {
				return fmt.Errorf("metrics: %w", err)
			}
			srv := &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 5 * time.Second}
			go func() { _ = srv.Serve(ln) }()
			defer srv.Close()
			metricsURL = "http://" + ln.Addr().String() + "/metrics"
		}
		rl, err := relay.New(pool, js, cfg)
		if err != nil {
			return err
		}
		if metricsURL != "" {
			fmt.Fprintf(r.env.Stdout, "ready pid=%d metrics=%s\n", os.Getpid(), metricsURL)
		} else {
			fmt.Fprintf(r.env.Stdout, "ready pid=%d\n", os.Getpid())
		}
		return rl.Run(ctx)
	}
}

// relayLogger logs the relay's warnings and errors only: progress lines are the bench's.
func relayLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
