package bench

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/redact"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/relay"
)

// LocalDSN is the PostgreSQL used when DATABASE_URL is unset and it answers.
const LocalDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// Stream settings of the yardstick: file storage, one replica (three with --nats-cluster), a
// two-minute duplicate window.
const (
	StreamDuplicates = 2 * time.Minute
	streamPrefix     = "BENCH_"
)

// run is one invocation of a scenario: its services, its schema and streams, and what to
// clean up at the end.
type run struct {
	env           *Env
	name          string
	keep          bool
	natsInProcess bool
	natsCluster   bool // a three-node cluster and R3 streams
	ownPostgres   bool // a throwaway cluster even when DATABASE_URL or the local server is there
	noWriteFence  bool // relays connect without relay.WriteFence (relay run dials through it)
	began         time.Time

	mu      sync.Mutex
	cleanup []func()
	errMu   sync.Mutex // serialises writes to env.Stderr

	DSN     string
	Admin   *pgxpool.Pool // no search_path; schema-qualified statements only
	NATSURL string
	natsPID int // the embedded nats-server's child process (0: none, or in this process)
	NC      *nats.Conn
	JS      jetstream.JetStream

	dbDesc, natsDesc string
}

// logf prints a progress line on stderr. Goroutines and child processes share stderr:
// writes to it are serialised (see stderr).
func (r *run) logf(format string, args ...any) {
	r.errMu.Lock()
	defer r.errMu.Unlock()
	if r.began.IsZero() {
		r.began = time.Now()
	}
	fmt.Fprintf(r.env.Stderr, "%s [%6.1fs] %s\n", r.name, time.Since(r.began).Seconds(), fmt.Sprintf(format, args...))
}

// stderr is the run's stderr for child processes, whose output is copied by goroutines of
// their own: each write holds the lock logf takes.
func (r *run) stderr() io.Writer { return lockedWriter{mu: &r.errMu, w: r.env.Stderr} }

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// result prints the final line: the scenario name and key=value pairs.
func (r *run) result(kv ...any) {
	var b strings.Builder
	b.WriteString(r.name)
	for i := 0; i+1 < len(kv); i += 2 {
		fmt.Fprintf(&b, " %v=%s", kv[i], formatValue(kv[i+1]))
	}
	fmt.Fprintln(r.env.Stdout, b.String())
}

func formatValue(v any) string {
	switch x := v.(type) {
	case float64:
		switch {
		case x >= 100 || x <= -100:
			return fmt.Sprintf("%.0f", x)
		case x >= 1 || x <= -1:
			return fmt.Sprintf("%.2f", x)
		default:
			return fmt.Sprintf("%.3f", x)
		}
	case time.Duration:
		return formatValue(x.Seconds() * 1000)
	}
	return fmt.Sprint(v)
}

func (r *run) atExit(f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cleanup = append(r.cleanup, f)
}

func (r *run) close() {
	r.mu.Lock()
	fs := r.cleanup
	r.cleanup = nil
	r.mu.Unlock()
	for i := len(fs) - 1; i >= 0; i-- {
		fs[i]()
	}
}

// start connects to (or starts) PostgreSQL and NATS.
func (r *run) start(ctx context.Context) error {
	r.logf("load average %s", loadAvg())
	r.DSN = r.env.Getenv("DATABASE_URL")
	switch {
	case r.ownPostgres:
		r.logf("starting a throwaway PostgreSQL (fsync on, the server's default settings: autovacuum on)")
		pg, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{Fsync: true})
		if err != nil {
			return err
		}
		r.atExit(pg.Stop)
		r.DSN, r.dbDesc = pg.DSN(), "throwaway cluster"
	case r.DSN != "":
		r.dbDesc = "DATABASE_URL"
	case embedded.Ping(ctx, LocalDSN, 2*time.Second) == nil:
		r.DSN, r.dbDesc = LocalDSN, "local 127.0.0.1:5432"
	default:
		r.logf("no DATABASE_URL and nothing on 127.0.0.1:5432: starting a throwaway PostgreSQL (fsync on)")
		pg, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{Fsync: true})
		if err != nil {
			return err
		}
		r.atExit(pg.Stop)
		r.DSN, r.dbDesc = pg.DSN(), "throwaway cluster"
	}
	admin, err := r.NewPool(ctx, 4)
	if err != nil {
		return err
	}
	r.Admin = admin
	var fsync, syncCommit, version string
	if err := admin.QueryRow(ctx, "SELECT current_setting('fsync'), current_setting('synchronous_commit'), current_setting('server_version')").
		Scan(&fsync, &syncCommit, &version); err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	r.logf("postgres %s (%s): fsync=%s synchronous_commit=%s", version, r.dbDesc, fsync, syncCommit)
	if fsync != "on" || syncCommit == "off" {
		r.logf("WARNING: fsync or synchronous_commit is off: results are not comparable with the yardstick")
	}

	r.NATSURL = r.env.Getenv("NATS_URL")
	switch {
	case r.NATSURL != "":
		r.natsDesc = "NATS_URL"
	case r.natsInProcess && r.natsCluster:
		c, err := embedded.StartCluster(embedded.ClusterOptions{})
		if err != nil {
			return err
		}
		r.atExit(c.Shutdown)
		r.NATSURL, r.natsDesc = c.URLs(), "embedded three-node cluster, in process"
	case r.natsInProcess:
		srv, err := embedded.StartNATS(embedded.NATSOptions{})
		if err != nil {
			return err
		}
		r.atExit(srv.Shutdown)
		r.NATSURL, r.natsDesc = srv.URL(), "embedded, in process"
	default:
		url, stop, err := r.startNATSProcess(ctx)
		if err != nil {
			return err
		}
		r.atExit(stop)
		r.NATSURL, r.natsDesc = url, "embedded, child process"
		if r.natsCluster {
			r.natsDesc = "embedded three-node cluster, child process"
		}
	}
	if r.NC, err = r.ConnectNATS("outbox-bench"); err != nil {
		return err
	}
	if r.JS, err = jetstream.New(r.NC); err != nil {
		return err
	}
	r.logf("nats %s (%s)", redact.NATS(r.NATSURL), r.natsDesc)
	return nil
}

// NewPool opens a pool on the run's database; tracer may be nil.
func (r *run) NewPool(ctx context.Context, maxConns int32, tracer ...pgx.QueryTracer) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(r.DSN)
	if err != nil {
		return nil, fmt.Errorf("invalid DATABASE_URL: %w", err)
	}
	cfg.MaxConns = maxConns
	if len(tracer) > 0 {
		cfg.ConnConfig.Tracer = tracer[0]
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "outbox-bench " + r.name
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	r.atExit(pool.Close)
	return pool, nil
}

// ConnectNATS opens a NATS connection of its own (the relay, the producers and the consumer
// each get one, as separate services would), with extra options after the defaults.
func (r *run) ConnectNATS(name string, extra ...nats.Option) (*nats.Conn, error) {
	opts := append([]nats.Option{nats.Name(name), nats.MaxReconnects(-1), nats.ReconnectWait(100 * time.Millisecond)}, extra...)
	nc, err := nats.Connect(r.NATSURL, opts...)
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w", redact.NATS(r.NATSURL), err)
	}
	r.atExit(nc.Close)
	return nc, nil
}

// relayNATSOptions are the NATS options of a relay's connection as relay run makes it: dialled
// through a relay.WriteFence, with no reconnect buffer (without the fence, with --no-write-fence).
func (r *run) relayNATSOptions() []nats.Option {
	if r.noWriteFence {
		return nil
	}
	return []nats.Option{nats.SetCustomDialer(relay.NewWriteFence(nil)), nats.ReconnectBufSize(-1)}
}

// ConnectRelayNATS connects a relay to NATS as relay run does (see relayNATSOptions).
func (r *run) ConnectRelayNATS(name string) (*nats.Conn, error) {
	return r.ConnectNATS(name, r.relayNATSOptions()...)
}

// NewSchema creates and migrates a fresh schema for the scenario, plus its business table
// bench_business, and drops it at exit unless --keep.
func (r *run) NewSchema(ctx context.Context) (string, error) {
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	schema := "bench_" + r.name + "_" + hex.EncodeToString(rnd[:])
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		return "", err
	}
	if _, err := m.Up(ctx, r.Admin); err != nil {
		return "", fmt.Errorf("migrate %s: %w", schema, err)
	}
	if r.keep {
		r.logf("schema %s (kept: --keep)", schema)
	} else {
		r.atExit(func() { r.dropSchema(schema) })
	}
	if _, err := r.Admin.Exec(ctx, "CREATE TABLE "+businessTable(schema)+` (
		id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		producer integer NOT NULL,
		seq      bigint  NOT NULL,
		note     text    NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return "", fmt.Errorf("create business table: %w", err)
	}
	return schema, nil
}

// dropSchema drops a scenario's schema (if it is still there).
func (r *run) dropSchema(schema string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := r.Admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		r.logf("drop schema %s: %v", schema, err)
	}
}

// businessTable is the scenario's business table, schema-qualified and quoted.
func businessTable(schema string) string {
	return pgx.Identifier{schema, "bench_business"}.Sanitize()
}

// outboxTable is the outbox table of schema, quoted.
func outboxTable(schema string) string {
	return pgx.Identifier{schema, "txoutbox_messages"}.Sanitize()
}

// ResetStream deletes the stream if it exists and creates it afresh with the yardstick's
// settings; it is deleted at exit unless --keep.
func (r *run) ResetStream(ctx context.Context, name string, subjects ...string) (jetstream.Stream, error) {
	if err := r.JS.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, fmt.Errorf("reset stream %s: %w", name, err)
	}
	cfg := jetstream.StreamConfig{
		Name:       name,
		Subjects:   subjects,
		Storage:    jetstream.FileStorage,
		Replicas:   r.replicas(),
		Duplicates: StreamDuplicates,
	}
	s, err := r.JS.CreateStream(ctx, cfg)
	// Right after the delete, the server may still be removing the old stream's files: the
	// create then fails with 10049 ("error creating store for stream"; seen once in the test
	// suite). Ask again for a few seconds, unless the run is stopped.
	var apiErr *jetstream.APIError
	for deadline := time.Now().Add(5 * time.Second); err != nil && errors.As(err, &apiErr) && apiErr.ErrorCode == 10049 && time.Now().Before(deadline); {
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("create stream %s on %v: %w (after %v)", name, subjects, ctx.Err(), err)
		case <-time.After(50 * time.Millisecond):
		}
		s, err = r.JS.CreateStream(ctx, cfg)
	}
	if err != nil {
		return nil, fmt.Errorf("create stream %s on %v: %w", name, subjects, err)
	}
	if !r.keep {
		r.atExit(func() { r.DeleteStream(name) })
	}
	if r.replicas() > 1 && len(subjects) > 0 {
		// A new replicated stream's leader takes a moment to be subscribed to its subjects on
		// every node: until then publishes get "no responders". Wait with one publish that
		// retries, then purge it, so that both publishers start on a stream that answers.
		subj := strings.NewReplacer(">", "ready", "*", "ready").Replace(subjects[0])
		if _, err := r.JS.Publish(ctx, subj, nil, jetstream.WithRetryAttempts(100), jetstream.WithRetryWait(50*time.Millisecond)); err != nil {
			return nil, fmt.Errorf("stream %s: first publish: %w", name, err)
		}
		if err := s.Purge(ctx); err != nil {
			return nil, fmt.Errorf("stream %s: purge: %w", name, err)
		}
	}
	return s, nil
}

// replicas is the streams' replica count: 3 with --nats-cluster, else 1.
func (r *run) replicas() int {
	if r.natsCluster {
		return 3
	}
	return 1
}

// DeleteStream deletes a stream, ignoring a missing one.
func (r *run) DeleteStream(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := r.JS.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		r.logf("delete stream %s: %v", name, err)
	}
}

// child is a child process re-executing this binary in an internal mode. Closing its stdin
// tells it to exit, so it also goes away when this process dies.
type child struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines *bufio.Scanner
	done  chan error
}

// startChild starts the binary with args and extra environment.
func (r *run) startChild(args []string, extraEnv ...string) (*child, error) {
	if r.env.Exe == "" {
		return nil, errors.New("cannot find this program's executable to start a child process")
	}
	if r.noWriteFence && len(args) > 0 && args[0] == relayMode {
		args = append([]string{relayMode, "--no-write-fence"}, args[1:]...)
	}
	cmd := exec.Command(r.env.Exe, args...)
	cmd.Env = append(append(os.Environ(), r.env.ExeEnv...), extraEnv...)
	cmd.Stderr = r.stderr()
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s %v: %w", r.env.Exe, args, err)
	}
	c := &child{cmd: cmd, stdin: stdin, lines: bufio.NewScanner(stdout), done: make(chan error, 1)}
	return c, nil
}

// readLine waits for the child's next stdout line.
func (c *child) readLine(timeout time.Duration) (string, error) {
	type res struct {
		line string
		ok   bool
	}
	ch := make(chan res, 1)
	go func() {
		ok := c.lines.Scan()
		ch <- res{c.lines.Text(), ok}
	}()
	select {
	case x := <-ch:
		if !x.ok {
			return "", fmt.Errorf("child process %v exited before it was ready", c.cmd.Args)
		}
		return x.line, nil
	case <-time.After(timeout):
		return "", fmt.Errorf("child process %v not ready within %s", c.cmd.Args, timeout)
	}
}

// stop closes the child's stdin, asks it to stop with SIGTERM and waits for it (killing it
// after timeout). It returns the child's exit error.
func (c *child) stop(timeout time.Duration) error {
	_ = c.stdin.Close()
	if c.cmd.Process != nil {
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
	}
	go func() {
		// Drain stdout so the child never blocks writing.
		for c.lines.Scan() {
		}
		c.done <- c.cmd.Wait()
	}()
	select {
	case err := <-c.done:
		return err
	case <-time.After(timeout):
		_ = c.cmd.Process.Kill()
		<-c.done
		return fmt.Errorf("child process %v did not stop within %s; killed", c.cmd.Args, timeout)
	}
}

// startNATSProcess starts an embedded nats-server (with JetStream) in a child process.
func (r *run) startNATSProcess(context.Context) (string, func(), error) {
	args := []string{natsServerMode}
	if r.natsCluster {
		args = append(args, "-cluster")
	}
	c, err := r.startChild(args)
	if err != nil {
		return "", nil, err
	}
	line, err := c.readLine(30 * time.Second)
	if err != nil {
		_ = c.stop(5 * time.Second)
		return "", nil, err
	}
	url, ok := strings.CutPrefix(line, "nats-url ")
	if !ok {
		_ = c.stop(5 * time.Second)
		return "", nil, fmt.Errorf("nats child process said %q", line)
	}
	r.natsPID = c.cmd.Process.Pid
	return url, func() {
		if err := c.stop(30 * time.Second); err != nil {
			r.logf("nats child process: %v", err)
		}
	}, nil
}

// loadAvg returns the 1, 5 and 15 minute load averages.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

// load1 returns the 1-minute load average for the final line.
func load1() string {
	f := strings.Fields(loadAvg())
	if len(f) == 0 {
		return "unknown"
	}
	return f[0]
}

// newRelay returns an in-process relay with the default settings (but schema and subjects), on
// a pool and a NATS connection of its own, as a deployment would run it.
func (r *run) newRelay(ctx context.Context, schema, subjects string, tracer ...pgx.QueryTracer) (*relay.Relay, error) {
	pool, err := r.NewPool(ctx, 4, tracer...)
	if err != nil {
		return nil, err
	}
	nc, err := r.ConnectRelayNATS("outbox-bench relay")
	if err != nil {
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	return relay.New(pool, js, &relay.Config{Schema: schema, Subjects: []string{subjects}, Logger: relayLogger(r.env.Stderr)})
}
