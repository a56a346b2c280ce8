package bench

import (
	"bytes"
	"context"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// childEnv makes the test binary act as outbox-bench when a scenario re-executes it.
const childEnv = "TXOUTBOX_BENCH_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		code := Main(ctx, os.Args[1:], nil)
		stop()
		os.Exit(code)
	}
	os.Exit(testsvc.Main(m))
}

// runBench runs the command against the test PostgreSQL and an embedded NATS of the test's own,
// and returns the exit status, the final line's key=value pairs and the progress output.
func runBench(t *testing.T, args ...string) (int, map[string]string, string) {
	t.Helper()
	dsn := testsvc.PostgresDSN(t)
	n := testsvc.NewNATS(t)
	var stdout, stderr bytes.Buffer
	env := &Env{
		Stdout: &stdout, Stderr: &stderr,
		Getenv: func(k string) string {
			switch k {
			case "DATABASE_URL":
				return dsn
			case "NATS_URL":
				return n.URL()
			}
			return ""
		},
		Exe:    os.Args[0],
		ExeEnv: []string{childEnv + "=1"},
	}
	code := Main(context.Background(), args, env)
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	kv := map[string]string{}
	if len(lines) > 0 {
		f := strings.Fields(lines[len(lines)-1])
		if len(f) > 0 {
			kv["scenario"] = f[0]
			for _, p := range f[1:] {
				k, v, _ := strings.Cut(p, "=")
				kv[k] = v
			}
		}
	}
	if len(lines) > 1 {
		t.Errorf("stdout has %d lines, want exactly one final line:\n%s", len(lines), stdout.String())
	}
	return code, kv, stderr.String()
}

func num(t *testing.T, kv map[string]string, key string) float64 {
	t.Helper()
	v, err := strconv.ParseFloat(kv[key], 64)
	if err != nil {
		t.Fatalf("final line has no number %s: %v (%v)", key, err, kv)
	}
	return v
}

func TestDrainSmall(t *testing.T) {
	t.Parallel()
	code, kv, log := runBench(t, "drain", "--msgs", "1050", "--per-tx", "100", "--keys", "7")
	if code != ExitOK {
		t.Fatalf("exit %d\n%s", code, log)
	}
	if kv["scenario"] != "drain" || kv["msgs"] != "1050" || kv["lost"] != "0" || kv["duplicates"] != "0" {
		t.Fatalf("final line %v", kv)
	}
	relay, ceil := num(t, kv, "relay_msgs_per_s"), num(t, kv, "ceiling_msgs_per_s")
	if relay <= 0 || ceil <= 0 {
		t.Fatalf("rates relay=%v ceiling=%v", relay, ceil)
	}
	if ratio := num(t, kv, "ratio"); ratio < relay/ceil*0.99 || ratio > relay/ceil*1.01 {
		t.Fatalf("ratio %v, want relay/ceiling = %v", ratio, relay/ceil)
	}
	if !strings.Contains(log, "business rows 11 (want 11)") || !strings.Contains(log, "misordered=0") {
		t.Fatalf("progress does not show the checks:\n%s", log)
	}
	// Every way the check can fail is on the final line; the claim's time is measured (the
	// relay claims in a batch with the promotion of due scheduled rows).
	for _, k := range []string{"unknown", "corrupt", "misordered"} {
		if kv[k] != "0" {
			t.Fatalf("final line's %s = %q, want 0: %v", k, kv[k], kv)
		}
	}
	if claim := num(t, kv, "claim_s"); claim <= 0 {
		t.Fatalf("claim_s = %v: the claims were not timed", claim)
	}
	if !strings.Contains(log, "claim") {
		t.Fatalf("no claim timing in the progress:\n%s", log)
	}
}

func TestLatencySmall(t *testing.T) {
	t.Parallel()
	code, kv, log := runBench(t, "latency", "--rate", "200", "--duration", "1s", "--producers", "2")
	if code != ExitOK {
		t.Fatalf("exit %d\n%s", code, log)
	}
	if kv["scenario"] != "latency" || kv["lost"] != "0" || kv["duplicates"] != "0" {
		t.Fatalf("final line %v", kv)
	}
	if tx := num(t, kv, "tx"); tx < 190 || tx > 201 {
		t.Fatalf("tx=%v, want about 200 (200 tx/s for 1s)", tx)
	}
	p50, p99, mx := num(t, kv, "p50_ms"), num(t, kv, "p99_ms"), num(t, kv, "max_ms")
	if p50 > p99 || p99 > mx || mx <= 0 {
		t.Fatalf("percentiles out of order: p50=%v p99=%v max=%v", p50, p99, mx)
	}
}

func TestIdleSmall(t *testing.T) {
	t.Parallel()
	code, kv, log := runBench(t, "idle", "--duration", "1s", "--settle", "0s")
	if code != ExitOK {
		t.Fatalf("exit %d\n%s", code, log)
	}
	if kv["scenario"] != "idle" || kv["lost"] != "0" || kv["duplicates"] != "0" {
		t.Fatalf("final line %v", kv)
	}
	if pct := num(t, kv, "cpu_pct"); pct < 0 || pct > 100 {
		t.Fatalf("cpu_pct=%v", pct)
	}
	if wall := num(t, kv, "wall_s"); wall < 1 {
		t.Fatalf("wall_s=%v, want at least the 1s asked for", wall)
	}
}

func TestConsumeSmall(t *testing.T) {
	t.Parallel()
	// 250 accounts: each gets two or three messages, and the few dozen messages in flight at
	// once still update distinct rows (fewer accounts would make concurrent batches deadlock).
	code, kv, log := runBench(t, "consume", "--msgs", "600", "--accounts", "250", "--concurrency", "2", "--batch-size", "10")
	if code != ExitOK {
		t.Fatalf("exit %d\n%s", code, log)
	}
	if kv["scenario"] != "consume" || kv["msgs"] != "600" || kv["concurrency"] != "2" || kv["batch_size"] != "10" ||
		kv["lost"] != "0" || kv["duplicates"] != "0" || kv["dead_letters"] != "0" {
		t.Fatalf("final line %v", kv)
	}
	per, batch := num(t, kv, "per_message_msgs_per_s"), num(t, kv, "batch_msgs_per_s")
	if set := num(t, kv, "batch_handler_msgs_per_s"); per <= 0 || batch <= 0 || set <= 0 {
		t.Fatalf("rates per_message=%v batch=%v batch_handler=%v", per, batch, set)
	}
	// Both modes checked their effects in the database: 600 dedup rows, balances summing to
	// 600 and each account at the count of messages naming it (3 for the first 100, else 2).
	for _, mode := range []string{"per-message", "batch", "batch-handler"} {
		want := mode + ": check: dedup rows 600 (+0 unknown), balance sum 600, accounts off 0 (missing 0, extra 0), dead letters 0, unacked 0"
		if !strings.Contains(log, want) {
			t.Fatalf("progress does not show %q:\n%s", want, log)
		}
	}
}

func TestConsumeCheckCountsEveryKindOfFault(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	set, err := newMsgSet(6, 8, 0) // accounts 1 (messages 0, 2, 4) and 2 (1, 3, 5)
	if err != nil {
		t.Fatal(err)
	}
	accounts := pgx.Identifier{db.Schema, "bench_accounts"}.Sanitize()
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE "+accounts+" (id integer PRIMARY KEY, balance bigint NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	check := func(balances [2]int64, keys ...string) consumeResult {
		t.Helper()
		for _, q := range []string{"DELETE FROM txoutbox_consumer_dedup", "DELETE FROM " + accounts} {
			if _, err := db.Pool.Exec(ctx, q); err != nil {
				t.Fatal(err)
			}
		}
		for _, k := range keys {
			cons, key, _ := strings.Cut(k, "/")
			if _, err := db.Pool.Exec(ctx, "INSERT INTO txoutbox_consumer_dedup (consumer, idempotency_key) VALUES ($1, $2)", cons, key); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := db.Pool.Exec(ctx, "INSERT INTO "+accounts+" VALUES (1, $1), (2, $2)", balances[0], balances[1]); err != nil {
			t.Fatal(err)
		}
		var res consumeResult
		if err := checkEffects(ctx, db.Pool, db.Schema, accounts, "c", set, 2, &res); err != nil {
			t.Fatal(err)
		}
		return res
	}
	var all []string
	for _, id := range set.ids {
		all = append(all, "c/"+id.String())
	}
	if res := check([2]int64{3, 3}, all...); !res.ok(6) || res.lost(6) != 0 {
		t.Fatalf("exactly-once effects fail the check: %s", res)
	}
	// Message 5 has no dedup row and its effect went to account 1 instead (a lost and a
	// duplicated effect); another consumer's row and an id never sent are unknown.
	res := check([2]int64{4, 2}, append(all[:5:5], "other/"+set.ids[5].String(), "c/never-sent")...)
	want := consumeResult{dedupRows: 5, unknownRows: 2, balanceSum: 6, wrongAccounts: 2, missingEffects: 1, extraEffects: 1}
	if res != want || res.ok(6) || res.lost(6) != 1 {
		t.Fatalf("check = %+v (lost %d), want %+v, lost 1, not ok", res, res.lost(6), want)
	}
	// Every dedup row there but one effect applied twice.
	if res := check([2]int64{4, 3}, all...); res.ok(6) || res.extraEffects != 1 || res.balanceSum != 7 {
		t.Fatalf("a duplicated effect passes the check: %s", res)
	}
}

// drain --relays: the same keyed backlog drained by one and by two relay processes, each run
// checked (nothing lost, duplicated or reordered per key), with the relays' CPU and peak RSS.
func TestDrainRelaysSmall(t *testing.T) {
	t.Parallel()
	code, kv, log := runBench(t, "drain", "--relays", "1,2", "--msgs", "1200", "--per-tx", "100", "--keys", "7")
	if code != ExitOK {
		t.Fatalf("exit %d\n%s", code, log)
	}
	if kv["scenario"] != "drain" || kv["relays"] != "1,2" || kv["lost"] != "0" || kv["duplicates"] != "0" {
		t.Fatalf("final line %v", kv)
	}
	r1, r2 := num(t, kv, "r1_msgs_per_s"), num(t, kv, "r2_msgs_per_s")
	if r1 <= 0 || r2 <= 0 || num(t, kv, "r1_ceiling_msgs_per_s") <= 0 {
		t.Fatalf("rates %v", kv)
	}
	if v := num(t, kv, "r2_vs_1_relay"); v < r2/r1*0.99 || v > r2/r1*1.01 {
		t.Fatalf("r2_vs_1_relay %v, want r2/r1 = %v", v, r2/r1)
	}
	if num(t, kv, "r1_peak_rss_kb") <= 0 || num(t, kv, "r2_cpu_relays") <= 0 || num(t, kv, "r1_cpu_us_per_msg") <= 0 {
		t.Fatalf("no memory or CPU figures: %v", kv)
	}
	for _, want := range []string{"1 relay(s): check: expected=1200 stored=1200 lost=0 duplicates=0 unknown=0 corrupt=0 misordered=0; business rows 12 (want 12)",
		"2 relay(s): check: expected=1200 stored=1200 lost=0 duplicates=0 unknown=0 corrupt=0 misordered=0; business rows 12 (want 12)",
		"relays settled 1200 published"} {
		if !strings.Contains(log, want) {
			t.Fatalf("progress does not show %q:\n%s", want, log)
		}
	}
}

func TestUsageErrors(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{}, {"nope"}, {"drain", "--nope"}, {"drain", "extra"}, {"drain", "--msgs", "0"},
		{"drain", "--relays", "0"}, {"drain", "--relays", "1,x"}, {"drain", "--relays", "1", "--repeat", "0"},
		{"consume", "--batch-size", "1"}, {"consume", "--concurrency", "0"}, {"consume", "--batch-handler-size", "1"},
		// Settings of the relay processes without them, and a run that measures nothing.
		{"drain", "--relay-batch-size", "2000"}, {"drain", "--relay-max-in-flight", "10"}, {"drain", "--repeat", "3"},
		{"scheduled", "--skip-drain", "--skip-lateness"}} {
		var out bytes.Buffer
		// Bad values are refused before any service is contacted.
		code := Main(context.Background(), args, &Env{Stdout: &out, Stderr: &out, Getenv: func(string) string { return "" }})
		if code != ExitUsage {
			t.Errorf("%q: exit %d, want %d\n%s", args, code, ExitUsage, out.String())
		}
	}
}

// header builds the headers the relay would publish for message i of set.
func header(set *msgSet, i int) nats.Header {
	return set.natsMsg(i, "bench.x").Header
}

func TestCheckerCountsEveryKindOfFault(t *testing.T) {
	t.Parallel()
	set, err := newMsgSet(6, 64, 2) // keys key-0 (0, 2, 4) and key-1 (1, 3, 5)
	if err != nil {
		t.Fatal(err)
	}
	rank := []int32{0, 1, 2, 3, 4, 5}
	c := newChecker(set, rank, 0)
	c.add(header(set, 0), set.payload(0))
	c.add(header(set, 4), set.payload(4)) // key-0 ahead of 2: misordered when 2 comes
	c.add(header(set, 2), set.payload(2))
	c.add(header(set, 2), set.payload(2)) // duplicate
	c.add(header(set, 1), []byte("tampered"))
	stranger := nats.Header{}
	stranger.Set(outbox.HeaderMsgID, "0190a8c4-0000-7000-8000-000000000000")
	c.add(stranger, nil) // never sent
	c.add(header(set, 3), set.payload(3))
	// 5 never arrives: lost.
	got := c.result()
	want := checkResult{Expected: 6, Msgs: 7, Lost: 1, Duplicates: 1, Unknown: 1, Corrupt: 1, Misordered: 1}
	if got != want || got.ok() {
		t.Fatalf("result %+v, want %+v (and not ok)", got, want)
	}

	clean := newChecker(set, rank, 0)
	for i := range 6 {
		clean.add(header(set, i), set.payload(i))
	}
	if res := clean.result(); !res.ok() {
		t.Fatalf("a complete, ordered stream fails the check: %s", res)
	}
}

func TestCheckStreamOnJetStream(t *testing.T) {
	t.Parallel()
	n := testsvc.NewNATS(t)
	n.Stream(t, "CHECK", "bench.check.>")
	set, err := newMsgSet(50, 128, 0)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := range 50 {
		m := set.natsMsg(i, "bench.check.m")
		switch i {
		case 10:
			continue // lost
		case 20:
			m.Data = append([]byte(nil), m.Data...)
			m.Data[0] ^= 1 // corrupted
		}
		if _, err := n.JS.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	res, err := checkStream(ctx, n.JS, "CHECK", set, nil)
	if err != nil {
		t.Fatal(err)
	}
	if want := (checkResult{Expected: 50, Msgs: 49, Lost: 1, Corrupt: 1}); res != want {
		t.Fatalf("check = %+v, want %+v", res, want)
	}
}

func TestPercentile(t *testing.T) {
	t.Parallel()
	var d []time.Duration
	for i := 100; i >= 1; i-- {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	sortDurations(d)
	for q, want := range map[float64]time.Duration{0.5: 50 * time.Millisecond, 0.9: 90 * time.Millisecond, 0.99: 99 * time.Millisecond, 1: 100 * time.Millisecond} {
		if got := percentile(d, q); got != want {
			t.Errorf("percentile(%v) = %s, want %s", q, got, want)
		}
	}
	if percentile(nil, 0.5) != 0 {
		t.Error("percentile of nothing is not 0")
	}
}

func TestProcCPUReadsThisProcess(t *testing.T) {
	t.Parallel()
	// Compare with getrusage, not with the wall clock: on a loaded machine a busy loop gets
	// little of the CPU. The reads are nested (procCPU outside) so procCPU's delta covers
	// getrusage's, less the 10ms clock-tick granularity of /proc at each end.
	rusage := func() time.Duration {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			t.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	before, err := procCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	r0 := rusage()
	x := 0
	for rusage()-r0 < 200*time.Millisecond {
		x++
	}
	r1 := rusage()
	after, err := procCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if got, want := after-before, r1-r0; got < want-30*time.Millisecond {
		t.Fatalf("procCPU counted %s while getrusage counted %s (x=%d)", got, want, x)
	}
}

// A short soak with a long transaction in the middle: every message once, in key order; the
// interval lines and the final line's figures are there. The targets are timings, so they do
// not decide this test (--targets=false).
func TestSoakSmall(t *testing.T) {
	t.Parallel()
	code, kv, log := runBench(t, "soak", "--rate", "200", "--duration", "4s", "--interval", "1s", "--window", "1s",
		"--producers", "4", "--keys", "16", "--hold-at", "1s", "--hold-xmin", "1500ms", "--targets=false")
	if code != ExitOK {
		t.Fatalf("exit %d\n%s", code, log)
	}
	if kv["scenario"] != "soak" || kv["lost"] != "0" || kv["duplicates"] != "0" || kv["misordered"] != "0" {
		t.Fatalf("final line %v", kv)
	}
	if kv["verdict"] != "ok" && kv["verdict"] != "missed" {
		t.Fatalf("verdict %q", kv["verdict"])
	}
	if tx := num(t, kv, "tx"); tx < 1 || tx > 801 {
		t.Fatalf("tx=%v, want at most 800 (200 tx/s for 4s)", tx)
	}
	for _, k := range []string{"first_p99_ms", "last_p99_ms", "first_claim_ms", "last_rss_kb", "hold_during_p99_ms", "hold_during_claim_ms", "recovery_s"} {
		if v := num(t, kv, k); v < 0 {
			t.Errorf("%s=%v", k, v)
		}
	}
	if num(t, kv, "last_rss_kb") <= 0 || num(t, kv, "first_claim_ms") <= 0 {
		t.Errorf("no relay RSS or claim time measured: %v", kv)
	}
	if num(t, kv, "hold_s") != 1.5 {
		t.Errorf("hold_s=%v, want 1.5", kv["hold_s"])
	}
}

// A small history: the hot path's plans never scan it, and the purge deletes what is past the
// retention.
func TestHistorySmall(t *testing.T) {
	t.Parallel()
	code, kv, log := runBench(t, "history", "--rows", "20000", "--batch", "50", "--purge-time", "1s", "--rate", "1")
	if code != ExitOK {
		t.Fatalf("exit %d\n%s", code, log)
	}
	if kv["scenario"] != "history" || kv["verdict"] != "ok" || kv["rows"] != "20000" {
		t.Fatalf("final line %v", kv)
	}
	for _, k := range []string{"claim_buffers", "claim_generic_buffers", "claim_floor_buffers", "settle_delete_buffers", "settle_retain_generic_buffers"} {
		if b := num(t, kv, k); b <= 0 || b > historyMaxBuffersPerRow*50 {
			t.Errorf("%s=%v, want between 1 and %d", k, b, historyMaxBuffersPerRow*50)
		}
	}
	if num(t, kv, "purge_rows_per_s") <= 0 {
		t.Errorf("the purge deleted nothing: %v", kv)
	}
}

// A ceiling that was not measured is left off the final line, not printed as 0.
func TestDrainSkipCeiling(t *testing.T) {
	t.Parallel()
	code, kv, log := runBench(t, "drain", "--msgs", "300", "--per-tx", "100", "--skip-ceiling")
	if code != ExitOK {
		t.Fatalf("exit %d\n%s", code, log)
	}
	for _, k := range []string{"ceiling_msgs_per_s", "ratio", "ceiling_s"} {
		if v, ok := kv[k]; ok {
			t.Fatalf("final line has %s=%s with --skip-ceiling: %v", k, v, kv)
		}
	}
	if num(t, kv, "relay_msgs_per_s") <= 0 {
		t.Fatalf("no relay rate: %v", kv)
	}
}
