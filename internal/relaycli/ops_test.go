package relaycli

import (
	"bytes"
	"context"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// A relay process with --metrics-addr: every metric family is on /metrics, /healthz and
// /readyz answer, /readyz turns 503 while NATS is away, and the status page is served.
func TestRunServesMetricsHealthAndStatusPage(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	n.Stream(t, "ORDERS", "orders.>")
	ctx := context.Background()
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := client.EnqueueTx(ctx, tx,
			outbox.Message{Subject: "orders.created", Key: "a"}, outbox.Message{Subject: "orders.created", Key: "b"},
			outbox.Message{Subject: "orders.paid"}, outbox.Message{Subject: "nowhere.at.all"}, // no stream: dead at once
		)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	p := startRelay(t, "relay-m", "run", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema,
		"--relay-id", "relay-m", "--metrics-addr", "127.0.0.1:0", "--log-format", "json",
		"--max-attempts", "1", "--sample-interval", "100ms", "--lease-interval", "200ms")
	addr, _ := p.waitLog(t, "serving metrics, health and the status page", 10*time.Second).Fields["addr"].(string)
	base := "http://" + addr

	var metrics string
	// Every sampled gauge awaited here: the per-partition backlog comes from a second query of
	// the sample, for the partitions held at that moment, and may lag the row counts.
	testsvc.Eventually(t, 15*time.Second, "published rows and sampled gauges", func() bool {
		var code int
		metrics, code = testsvc.HTTPGet(t, base+"/metrics")
		return code == 200 && strings.Contains(metrics, "txoutbox_relay_published_total 3") &&
			strings.Contains(metrics, `txoutbox_outbox_messages{state="dead"} 1`) &&
			strings.Contains(metrics, `txoutbox_outbox_messages{state="ready"} 0`) &&
			strings.Contains(metrics, `txoutbox_relay_ready_backlog{partition="0"} 0`)
	})
	for _, family := range []string{
		"txoutbox_relay_published_total", "txoutbox_relay_duplicates_total", "txoutbox_relay_publish_failures_total",
		"txoutbox_relay_dead_total", "txoutbox_relay_batch_size_bucket", "txoutbox_relay_commit_to_publish_seconds_bucket",
		"txoutbox_relay_partitions_held", "txoutbox_relay_partition_target", "txoutbox_relay_relays",
		"txoutbox_relay_partition_changes_total", "txoutbox_relay_partition_count_mismatch",
		"txoutbox_relay_ready_backlog", "txoutbox_relay_oldest_ready_age_seconds",
		"txoutbox_outbox_messages", "txoutbox_outbox_oldest_ready_age_seconds", "txoutbox_relay_sample_errors_total",
		"go_goroutines", "process_resident_memory_bytes",
	} {
		if !strings.Contains(metrics, "\n"+family) {
			t.Errorf("/metrics lacks %s", family)
		}
	}
	for _, line := range []string{
		`txoutbox_relay_publish_failures_total{kind="message"} 1`, "txoutbox_relay_dead_total 1",
		"txoutbox_relay_partitions_held 8", `txoutbox_relay_partition_changes_total{change="taken"} 8`,
		`txoutbox_relay_ready_backlog{partition="0"} 0`,
	} {
		if !strings.Contains(metrics, line) {
			t.Errorf("/metrics lacks %q", line)
		}
	}

	if body, code := testsvc.HTTPGet(t, base+"/healthz"); code != 200 || body != "ok\n" {
		t.Errorf("/healthz = %d %q", code, body)
	}
	// The rows are settled before the relay records its first round as done (health
	// "starting" until then): give it that moment.
	var ready string
	var readyCode int
	testsvc.Eventually(t, 5*time.Second, "/readyz", func() bool {
		ready, readyCode = testsvc.HTTPGet(t, base+"/readyz")
		return readyCode == 200
	})
	if ready != "ok: ok, partitions held 8\n" {
		t.Errorf("/readyz = %d %q", readyCode, ready)
	}
	if body, code := testsvc.HTTPGet(t, base+"/"); code != 200 || !strings.Contains(body, "relay-m") || !strings.Contains(body, "nowhere.at.all") {
		t.Errorf("status page = %d, lacks the relay or the dead row's subject", code)
	}

	n.Stop()
	testsvc.Eventually(t, 10*time.Second, "/readyz to fail while NATS is away", func() bool {
		body, code := testsvc.HTTPGet(t, base+"/readyz")
		return code == 503 && strings.Contains(body, "nats:")
	})
	if body, code := testsvc.HTTPGet(t, base+"/healthz"); code != 200 {
		t.Errorf("/healthz while NATS is away = %d %q, want 200 (the process is alive)", code, body)
	}
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	testsvc.Eventually(t, 15*time.Second, "/readyz to recover", func() bool {
		_, code := testsvc.HTTPGet(t, base+"/readyz")
		return code == 200
	})
	if code := p.stop(t, syscall.SIGTERM); code != 0 {
		t.Fatalf("relay exited %d after SIGTERM, want 0", code)
	}
}

// `relay checkback` run on its own with --metrics-addr: the check-back's families (with the
// check it made) and the Go and process collectors are on /metrics, and /readyz answers.
func TestCheckbackServesMetricsAndHealth(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	ctx := context.Background()
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	// Nobody serves the group "orders": its one allowed check finds no responders.
	if _, err := client.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Group: "orders"}); err != nil {
		t.Fatal(err)
	}
	p := startRelay(t, "checkback-m", "checkback", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema,
		"--metrics-addr", "127.0.0.1:0", "--log-format", "json",
		"--check-transaction-timeout", "1ms", "--check-max", "1", "--check-schedule", "@every 100ms")
	addr, _ := p.waitLog(t, "serving metrics, health and the status page", 10*time.Second).Fields["addr"].(string)
	base := "http://" + addr

	var metrics string
	testsvc.Eventually(t, 10*time.Second, "the check counted", func() bool {
		var code int
		metrics, code = testsvc.HTTPGet(t, base+"/metrics")
		return code == 200 && strings.Contains(metrics, `txoutbox_checkback_checks_total{outcome="no_responders"} 1`)
	})
	for _, family := range []string{
		"txoutbox_checkback_checks_total", "txoutbox_checkback_resolved_total", "txoutbox_checkback_exhausted_total",
		"txoutbox_checkback_job_duration_seconds_bucket", "go_goroutines", "process_resident_memory_bytes",
	} {
		if !strings.Contains(metrics, "\n"+family) {
			t.Errorf("/metrics lacks %s", family)
		}
	}
	if body, code := testsvc.HTTPGet(t, base+"/healthz"); code != 200 || body != "ok\n" {
		t.Errorf("/healthz = %d %q", code, body)
	}
	if body, code := testsvc.HTTPGet(t, base+"/readyz"); code != 200 || body != "ok\n" {
		t.Errorf("/readyz = %d %q", code, body)
	}
	if code := p.stop(t, syscall.SIGTERM); code != 0 {
		t.Fatalf("checkback exited %d after SIGTERM, want 0", code)
	}

	// A bad address is a usage error, as for relay run.
	if code, _, errOut := cliEnv(t, nil, "checkback", "--database-url", db.DSN, "--metrics-addr", "9090"); code != 2 || !strings.Contains(errOut, "--metrics-addr") {
		t.Errorf("checkback --metrics-addr 9090: exit %d: %s", code, errOut)
	}
}

// A --metrics-addr (or TXOUTBOX_METRICS_ADDR) whose port is not a number from 0 to 65535 is a
// usage error naming the setting (exit status 2), for relay run and relay checkback alike,
// before anything connects: 127.0.0.1:99999 passed the check (SplitHostPort only) and exited 1
// at listen time ("ops: listen on …: invalid port").
func TestMetricsAddrPortIsChecked(t *testing.T) {
	t.Parallel()
	dsn := "postgres://nobody@127.0.0.1:1/none?connect_timeout=1"
	// Bounded: a command that took the address would wait for that database until stopped.
	cliEnv := func(t *testing.T, vars map[string]string, args ...string) (int, string, string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		var out, errOut bytes.Buffer
		code := Main(ctx, args, &Env{Stdout: &out, Stderr: &errOut, Getenv: func(k string) string { return vars[k] }})
		return code, out.String(), errOut.String()
	}
	for _, addr := range []string{"127.0.0.1:99999", "127.0.0.1:65536", ":-1", "127.0.0.1:", "127.0.0.1:http", "9090", "[::1]:1e3"} {
		for _, cmd := range [][]string{{"run", "--nats-url", "nats://127.0.0.1:1"}, {"checkback", "--nats-url", "nats://127.0.0.1:1"}} {
			args := append(append([]string{}, cmd...), "--database-url", dsn)
			code, _, errOut := cliEnv(t, nil, append(args, "--metrics-addr", addr)...)
			if code != 2 || !strings.Contains(errOut, "--metrics-addr") || !strings.Contains(errOut, addr) {
				t.Errorf("relay %s --metrics-addr %s: exit %d: %s; want exit 2 naming the setting", cmd[0], addr, code, errOut)
			}
			code, _, errOut = cliEnv(t, map[string]string{"TXOUTBOX_METRICS_ADDR": addr}, args...)
			if code != 2 || !strings.Contains(errOut, "metrics-addr") {
				t.Errorf("relay %s with TXOUTBOX_METRICS_ADDR=%s: exit %d: %s; want exit 2 naming the setting", cmd[0], addr, code, errOut)
			}
		}
	}
	// A port in use fails at listen time (exit 1: it may be freed), naming the setting.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for _, cmd := range []string{"run", "checkback"} {
		code, _, errOut := cliEnv(t, nil, cmd, "--nats-url", "nats://127.0.0.1:1", "--database-url", dsn, "--metrics-addr", ln.Addr().String())
		if code != 1 || !strings.Contains(errOut, "--metrics-addr (TXOUTBOX_METRICS_ADDR)") || !strings.Contains(errOut, "address already in use") {
			t.Errorf("relay %s --metrics-addr on a port in use: exit %d: %s; want exit 1 naming the setting", cmd, code, errOut)
		}
	}
	for _, addr := range []string{"", "127.0.0.1:0", ":9090", "[::1]:65535", "localhost:09090"} {
		if err := checkMetricsAddr(addr); err != nil {
			t.Errorf("checkMetricsAddr(%q): %v", addr, err)
		}
	}
}
