package ops

import (
	"bytes"
	"context"
	"encoding/json"
	"image"
	"image/png"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/internal/status"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

func TestMain(m *testing.M) { os.Exit(testsvc.Main(m)) }

func TestHealthReadyAndMetrics(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "txoutbox_test_gauge", Help: "x"})
	reg.MustRegister(g)
	g.Set(42)
	var problems atomic.Value
	problems.Store([]string(nil))
	srv, err := Start(&Config{
		Addr:     "127.0.0.1:0",
		Gatherer: reg,
		Ready:    func(context.Context) []string { return problems.Load().([]string) },
		Self:     func() Self { return Self{Name: "r1", Health: "ok", Held: []int32{1, 2}} },
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	base := "http://" + srv.Addr()
	if body, code := testsvc.HTTPGet(t, base+"/healthz"); code != 200 || body != "ok\n" {
		t.Fatalf("/healthz = %d %q", code, body)
	}
	if body, code := testsvc.HTTPGet(t, base+"/readyz"); code != 200 || body != "ok: ok, partitions held 2\n" {
		t.Fatalf("/readyz = %d %q", code, body)
	}
	problems.Store([]string{"nats: RECONNECTING"})
	if body, code := testsvc.HTTPGet(t, base+"/readyz"); code != 503 || !strings.Contains(body, "nats: RECONNECTING") {
		t.Fatalf("/readyz while NATS is away = %d %q, want 503 naming it", code, body)
	}
	if body, code := testsvc.HTTPGet(t, base+"/metrics"); code != 200 || !strings.Contains(body, "txoutbox_test_gauge 42") {
		t.Fatalf("/metrics = %d %q", code, body)
	}
	if _, code := testsvc.HTTPGet(t, base+"/nope"); code != 404 {
		t.Fatalf("/nope = %d, want 404", code)
	}
}

// pageEnv is an outbox with a known state: a backlog of 30 on orders.created and 10 on
// orders.paid, 2 dead rows, and a relay "relay-x" holding partitions 0-5 of 8 (a real
// registration and real advisory locks on a session of its own).
func pageEnv(t *testing.T) (*Server, *status.Snapshot) {
	t.Helper()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var msgs []outbox.Message
	for i := 0; i < 30; i++ {
		msgs = append(msgs, outbox.Message{Subject: "orders.created", Payload: []byte("x")})
	}
	for i := 0; i < 12; i++ {
		msgs = append(msgs, outbox.Message{Subject: "orders.paid", Payload: []byte("x")})
	}
	var ids []uuid.UUID
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		ids, err = c.EnqueueTx(ctx, tx, msgs...)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'dead', attempts = 20 WHERE message_id = ANY($1)`, ids[40:]); err != nil {
		t.Fatal(err)
	}
	q := store.New(db.Schema)
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
	if err := q.RegisterRelay(ctx, conn, store.RelayRegistration{Instance: uuid.New(), RelayID: "relay-x", Partitions: 8, LeaseInterval: time.Second}); err != nil {
		t.Fatal(err)
	}
	if got, err := q.TryLockPartitions(ctx, conn, []int32{0, 1, 2, 3, 4, 5}); err != nil || len(got) != 6 {
		t.Fatalf("lock partitions: %v %v", got, err)
	}
	t.Cleanup(func() { _, _ = q.UnlockPartitions(context.Background(), conn, []int32{0, 1, 2, 3, 4, 5}) })

	var published atomic.Int64
	srv, err := Start(&Config{
		Addr:             "127.0.0.1:0",
		ThroughputSample: 20 * time.Millisecond,
		Snapshot: func(ctx context.Context) (*status.Snapshot, error) {
			return status.Collect(ctx, db.Pool, q, nil)
		},
		Self: func() Self {
			return Self{Name: "relay-x", Health: "ok", Held: []int32{0, 1, 2, 3, 4, 5}, Target: 6, Relays: 1, Published: published.Add(7)}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	// A few throughput samples for the graph: each sample reads Self, which adds 7.
	testsvc.Eventually(t, 10*time.Second, "five throughput samples", func() bool { return published.Load() >= 5*7 })
	snap, err := status.Collect(ctx, db.Pool, q, nil)
	if err != nil {
		t.Fatal(err)
	}
	return srv, snap
}

func TestStatusPageAndJSON(t *testing.T) {
	t.Parallel()
	srv, snap := pageEnv(t)
	if snap.Totals.Ready != 40 || snap.Totals.Dead != 2 || len(snap.Relays) != 1 || len(snap.Relays[0].Held) != 6 {
		t.Fatalf("snapshot = %+v", snap)
	}
	base := "http://" + srv.Addr()
	page, code := testsvc.HTTPGet(t, base+"/")
	if code != 200 {
		t.Fatalf("/ = %d", code)
	}
	for _, want := range []string{"orders.created", "orders.paid", "relay-x", "Dead rows", ">40<", ">2<",
		"2 of 8 partitions have no holder", `class="card alert"`, "width:320px", "width:107px", "<polyline"} {
		if !strings.Contains(page, want) {
			t.Errorf("status page lacks %q", want)
		}
	}
	if strings.Contains(page, "ZgotmplZ") {
		t.Error("the template rejected a value (ZgotmplZ in the page)")
	}
	body, code := testsvc.HTTPGet(t, base+"/status.json")
	var js struct {
		Self       Self             `json:"self"`
		Throughput float64          `json:"throughput_per_second"`
		Snapshot   *status.Snapshot `json:"snapshot"`
	}
	if code != 200 || json.Unmarshal([]byte(body), &js) != nil || js.Snapshot == nil || js.Snapshot.Totals.Ready != 40 || js.Throughput <= 0 {
		t.Fatalf("/status.json = %d %s", code, body)
	}
	if js.Self.Name != "relay-x" {
		t.Errorf("/status.json self.name = %q", js.Self.Name)
	}
	// snake_case keys everywhere, and no null where a list is empty.
	var doc any
	if err := json.Unmarshal([]byte(body), &doc); err != nil {
		t.Fatal(err)
	}
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch x := v.(type) {
		case map[string]any:
			for k, e := range x {
				if k == "" || strings.ToLower(k) != k || strings.ContainsAny(k, "- ") {
					t.Errorf("/status.json key %s.%s is not snake_case", path, k)
				}
				if e == nil && k != "error" {
					t.Errorf("/status.json %s.%s is null", path, k)
				}
				walk(path+"."+k, e)
			}
		case []any:
			for _, e := range x {
				walk(path+"[]", e)
			}
		}
	}
	walk("", doc)
}

// chromium finds Debian's Chromium (the CI script installs it).
func chromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("TXOUTBOX_CHROMIUM"); p != "" {
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Skip("skipping the browser test: no chromium on PATH (install it with `apt-get install -y chromium`; .ci/run does)")
	return ""
}

func runChromium(t *testing.T, bin string, args ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	base := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
		"--hide-scrollbars", "--force-device-scale-factor=1", "--user-data-dir=" + t.TempDir()}
	cmd := exec.CommandContext(ctx, bin, append(base, args...)...)
	var stdout strings.Builder
	cmd.Stdout = &stdout
	stderr := &strings.Builder{}
	cmd.Stderr = stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("chromium %v: %v\n%s", args, err, stderr.String())
	}
	return []byte(stdout.String())
}

// The status page in a real browser: the screenshot shows the backlog bars in proportion, the
// dead-rows card in red and the six partitions the relay holds in its color.
func TestStatusPageInChromium(t *testing.T) {
	t.Parallel()
	bin := chromium(t)
	srv, _ := pageEnv(t)
	url := "http://" + srv.Addr() + "/"

	dom := string(runChromium(t, bin, "--dump-dom", url))
	for _, want := range []string{"orders.created", "orders.paid", "relay-x", "Backlog by subject", "Partitions (8) and their holders"} {
		if !strings.Contains(dom, want) {
			t.Errorf("the DOM Chromium rendered lacks %q", want)
		}
	}

	shot := filepath.Join(t.TempDir(), "status.png")
	if dir := os.Getenv("TXOUTBOX_SCREENSHOT_DIR"); dir != "" {
		shot = filepath.Join(dir, "status-page.png")
	}
	runChromium(t, bin, "--window-size=1280,1300", "--screenshot="+shot, url)
	f, err := os.Open(shot)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() != 1280 || b.Dy() != 1300 {
		t.Fatalf("screenshot is %v, want 1280x1300", b)
	}
	bar, dead, holder := hexRGB(ColorBar), hexRGB(ColorDead), hexRGB(HolderColors[0])

	// The backlog bars: the longest horizontal runs of the bar color, per row.
	runs := map[int]int{} // run length -> rows
	counts := map[[3]uint8]int{}
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y++ {
		run, longest := 0, 0
		for x := b.Min.X; x < b.Max.X; x++ {
			c := rgb(img, x, y)
			counts[c]++
			if near(c, bar) {
				run++
				longest = max(longest, run)
			} else {
				run = 0
			}
		}
		if longest > 0 {
			runs[longest]++
		}
	}
	var lengths []int
	for l, rows := range runs {
		if rows >= 8 { // a bar is 14px high
			lengths = append(lengths, l)
		}
	}
	sort.Sort(sort.Reverse(sort.IntSlice(lengths)))
	if len(lengths) != 2 || abs(lengths[0]-320) > 2 || abs(lengths[1]-107) > 2 {
		t.Fatalf("backlog bars in the screenshot are %v px long, want 320 and 107 (30 and 10 rows)", lengths)
	}
	deadPx := countNear(counts, dead)
	if deadPx < 8000 {
		t.Fatalf("the dead-rows card shows %d red pixels, want a red card (at least 8000)", deadPx)
	}
	// Six 44x44 cells in the holder's color (less their white digits) plus a 12x12 swatch.
	cellPx := countNear(counts, holder)
	if cellPx < 6*44*44*7/10 || cellPx > 6*44*44+200 {
		t.Fatalf("%d pixels in the holder's color, want about six 44px partition cells", cellPx)
	}
	t.Logf("screenshot %s: bars %v px, dead card %d px, held partition cells %d px", shot, lengths, deadPx, cellPx)
}

func hexRGB(s string) [3]uint8 {
	var c [3]uint8
	for i := 0; i < 3; i++ {
		var v uint8
		for _, ch := range s[1+2*i : 3+2*i] {
			v *= 16
			switch {
			case ch >= '0' && ch <= '9':
				v += uint8(ch - '0')
			default:
				v += uint8(ch-'a') + 10
			}
		}
		c[i] = v
	}
	return c
}

func rgb(img image.Image, x, y int) [3]uint8 {
	r, g, b, _ := img.At(x, y).RGBA()
	return [3]uint8{uint8(r >> 8), uint8(g >> 8), uint8(b >> 8)}
}

func near(a, b [3]uint8) bool {
	for i := range a {
		if abs(int(a[i])-int(b[i])) > 3 {
			return false
		}
	}
	return true
}

func countNear(counts map[[3]uint8]int, c [3]uint8) int {
	n := 0
	for k, v := range counts {
		if near(k, c) {
			n += v
		}
	}
	return n
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// Listening beyond loopback is allowed, with a warning; loopback is quiet.
func TestNonLoopbackListenerWarns(t *testing.T) {
	t.Parallel()
	for addr, warn := range map[string]bool{"127.0.0.1:0": false, ":0": true} {
		var buf bytes.Buffer
		srv, err := Start(&Config{Addr: addr, Logger: slog.New(slog.NewTextHandler(&buf, nil))})
		if err != nil {
			t.Fatal(err)
		}
		srv.Close()
		if got := strings.Contains(buf.String(), "reachable from other hosts"); got != warn {
			t.Errorf("listen on %s: warned %v, want %v (log: %s)", addr, got, warn, buf.String())
		}
	}
}
