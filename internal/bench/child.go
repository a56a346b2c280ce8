package bench

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
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
// parent closed it, or died). A line "go" on stdin closes goLine (nil: none expected).
func untilStdinCloses(ctx context.Context, goLine chan<- struct{}) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		defer cancel()
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			if sc.Text() == "go" && goLine != nil {
				close(goLine)
				goLine = nil
			}
		}
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
			ctx, cancel := untilStdinCloses(ctx, nil)
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
		ctx, cancel := untilStdinCloses(ctx, nil)
		defer cancel()
		<-ctx.Done()
		return nil
	}
}

func relayFlags(fs *flag.FlagSet) func(context.Context, *run) error {
	schema := fs.String("schema", "", "outbox schema")
	subjects := fs.String("subjects", "", "comma-separated subjects")
	metricsAddr := fs.String("metrics-addr", "", "serve the relay's Prometheus metrics on this address (host:port; port 0 picks one); the ready line names it")
	id := fs.String("id", "", "relay id (default: the relay's own, hostname:pid)")
	waitGo := fs.Bool("wait-go", false, "after printing ready, wait for a line \"go\" on stdin before running (so that the parent times the relays, not their start-up)")
	cpuprofile := fs.String("cpuprofile", "", "write a CPU profile (pprof) of this process, from go to exit, to this file")
	batchSize := fs.Int("batch-size", 0, "the relay's BatchSize (0: the default)")
	maxInFlight := fs.Int("max-in-flight", 0, "the relay's MaxInFlight (0: the default)")
	report := fs.Bool("report", false, "print a line on stdout whenever the partitions held change, and the relay's totals at exit")
	return func(ctx context.Context, r *run) error {
		goLine := make(chan struct{})
		ctx, cancel := untilStdinCloses(ctx, goLine)
		defer cancel()
		dsn, url := r.env.Getenv("DATABASE_URL"), r.env.Getenv("NATS_URL")
		if dsn == "" || url == "" {
			return usageErr("%s needs DATABASE_URL and NATS_URL", relayMode)
		}
		pcfg, err := pgxpool.ParseConfig(dsn)
		if err != nil {
			return fmt.Errorf("invalid DATABASE_URL: %w", err)
		}
		pcfg.ConnConfig.RuntimeParams["application_name"] = "outbox-bench relay"
		pool, err := pgxpool.NewWithConfig(ctx, pcfg)
		if err != nil {
			return err
		}
		defer pool.Close()
		nc, err := nats.Connect(url, append([]nats.Option{nats.Name("outbox-bench relay"), nats.MaxReconnects(-1)}, r.relayNATSOptions()...)...)
		if err != nil {
			return err
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		cfg := &relay.Config{
			ID:          *id,
			Schema:      *schema,
			Subjects:    strings.Split(*subjects, ","),
			BatchSize:   *batchSize,
			MaxInFlight: *maxInFlight,
			Logger:      relayLogger(r.env.Stderr),
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
		if *waitGo {
			select {
			case <-goLine:
			case <-ctx.Done():
				return nil
			}
		}
		stopProfile, err := startProfile(*cpuprofile)
		if err != nil {
			return err
		}
		defer stopProfile()
		var wg sync.WaitGroup
		if *report {
			rctx, stop := context.WithCancel(ctx)
			defer func() { stop(); wg.Wait() }()
			wg.Add(1)
			go func() { defer wg.Done(); reportLease(rctx, r.env.Stdout, rl) }()
		}
		err = rl.Run(ctx)
		if *report {
			st := rl.Stats()
			fmt.Fprintf(r.env.Stdout, "stats published=%d duplicates=%d failed=%d dead=%d batches=%d withheld=%d\n",
				st.Published, st.Duplicates, st.Failed, st.Dead, st.Batches, st.Withheld)
		}
		return err
	}
}

// reportLease prints "lease held=H target=T relays=N" whenever what the relay holds changes,
// until ctx ends.
func reportLease(ctx context.Context, w io.Writer, rl *relay.Relay) {
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	last := ""
	for {
		st := rl.Lease()
		line := fmt.Sprintf("lease held=%d target=%d relays=%d published=%d", len(st.Held), st.Target, st.Relays, rl.Stats().Published)
		if cut := strings.LastIndex(line, " published="); line[:cut] != last {
			last = line[:cut]
			fmt.Fprintln(w, line)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// relayLogger logs the relay's warnings and errors only: progress lines are the bench's.
func relayLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
