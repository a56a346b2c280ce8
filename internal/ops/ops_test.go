package ops

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"image"
	"image/png"
	"log/slog"
	"math"
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
// orders.paid, all of key order-7 and held back by the key's first 2 rows, which are dead; a
// half message of group payments whose last check found no checker; a relay "relay-x"
// holding partitions 0-5 of 8 (a real registration and real advisory locks on a session of
// its own), and a relay "relay-y" holding none, whose NATS connection is down.
func pageEnv(t *testing.T) (srv *Server, snap *status.Snapshot, deadID uuid.UUID) {
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
		msgs = append(msgs, outbox.Message{Subject: "orders.paid", Key: "order-7", Payload: []byte("x")})
	}
	// Delayed messages (after the others: ids[30:32] are the dead rows below): the scheduled panel.
	for i, in := range []time.Duration{30 * time.Minute, 2 * time.Hour, 24 * time.Hour} {
		msgs = append(msgs, outbox.Message{Subject: "orders.timeout", Key: fmt.Sprintf("order-%d", 20+i), Payload: []byte("x"),
			BizKey: fmt.Sprintf("order:%d:timeout", 20+i), DeliverAt: time.Now().Add(in)})
	}
	var ids []uuid.UUID
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		ids, err = c.EnqueueTx(ctx, tx, msgs...)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'dead', attempts = 20,
		last_error = 'nats: maximum payload exceeded' WHERE message_id = ANY($1)`, ids[30:32]); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, producer_group, check_mode,
		check_count, next_check_at, last_error)
		VALUES ($1, 'payments.captured', 3, '', 'prepared', 'payments', 'checker', 4, now(), 'no_responders: no checker serves txoutbox.check.payments')`,
		uuid.New()); err != nil {
		t.Fatal(err)
	}
	deadID = ids[30]
	q := store.New(db.Schema)
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
	// A long lease interval keeps the relays alive (their heartbeats recent enough) however
	// slowly a loaded machine gets to the page.
	if err := q.RegisterRelay(ctx, conn, store.RelayRegistration{Instance: uuid.New(), RelayID: "relay-x", Partitions: 8, LeaseInterval: time.Hour,
		RelayInfo: store.RelayInfo{Version: "v1.4.0", Health: "ok", NATS: "CONNECTED", Published: 51234, PublishRate: 312.4}}); err != nil {
		t.Fatal(err)
	}
	other, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Release)
	if err := q.RegisterRelay(ctx, other, store.RelayRegistration{Instance: uuid.New(), RelayID: "relay-y", Partitions: 8, LeaseInterval: time.Hour,
		RelayInfo: store.RelayInfo{Version: "v1.3.2", Health: "nats_unavailable", NATS: "RECONNECTING", Published: 12, PublishRate: 0.2}}); err != nil {
		t.Fatal(err)
	}
	if got, err := q.TryLockPartitions(ctx, conn, []int32{0, 1, 2, 3, 4, 5}); err != nil || len(got) != 6 {
		t.Fatalf("lock partitions: %v %v", got, err)
	}
	t.Cleanup(func() { _, _ = q.UnlockPartitions(context.Background(), conn, []int32{0, 1, 2, 3, 4, 5}) })

	var calls atomic.Int64
	start := time.Now()
	srv, err = Start(&Config{
		Addr:             "127.0.0.1:0",
		ThroughputSample: 20 * time.Millisecond,
		Snapshot: func(ctx context.Context) (*status.Snapshot, error) {
			return status.Collect(ctx, db.Pool, q, nil)
		},
		Message: func(ctx context.Context, id uuid.UUID) (*store.MessageDetail, error) {
			return q.Message(ctx, db.Pool, id)
		},
		Schema: db.Schema,
		Self: func() Self {
			// About 300 messages a second, in waves: the throughput graph has a shape.
			calls.Add(1)
			sec := time.Since(start).Seconds()
			return Self{Name: "relay-x", Health: "ok", Held: []int32{0, 1, 2, 3, 4, 5}, Target: 6, Relays: 2, Published: int64(300*sec + 8*math.Sin(10*sec))}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	// A few throughput samples for the graph: each sample reads Self.
	testsvc.Eventually(t, 10*time.Second, "five throughput samples", func() bool { return calls.Load() >= 5 })
	snap, err = status.Collect(ctx, db.Pool, q, nil)
	if err != nil {
		t.Fatal(err)
	}
	return srv, snap, deadID
}

func TestStatusPageAndJSON(t *testing.T) {
	t.Parallel()
	srv, snap, deadID := pageEnv(t)
	if snap.Totals.Ready != 40 || snap.Totals.Dead != 2 || snap.Totals.Blocked != 10 || len(snap.Relays) != 2 || len(snap.Relays[0].Held) != 6 {
		t.Fatalf("snapshot = %+v", snap)
	}
	base := "http://" + srv.Addr()
	page, code := testsvc.HTTPGet(t, base+"/")
	if code != 200 {
		t.Fatalf("/ = %d", code)
	}
	for _, want := range []string{"orders.created", "orders.paid", "relay-x", "Dead rows", ">40<", ">2<",
		"2 of 8 partitions have no holder", `class="card alert"`, "width:320px", "width:107px", "<polyline",
		// blocked keys: the key, how many wait, a link to the dead row
		"Blocked keys", "<code>order-7</code>", `<a href="/messages/` + deadID.String() + `">`, "nats: maximum payload exceeded",
		"2 dead rows: 10 ready rows of 1 key wait behind them",
		// the producer group whose checks find no checker, flagged with its last error
		`<tr class="flagged"><td>payments</td>`, "no_responders: no checker serves txoutbox.check.payments",
		"producer group payments: its checks find no checker",
		// the fleet: both relays, their version, health, NATS state and throughput
		"v1.4.0", "v1.3.2", `<span class="pill good">CONNECTED</span>`, `<span class="pill poor">RECONNECTING</span>`,
		`<span class="pill poor">nats_unavailable</span>`, ">312.4/s<", ">0.2/s<", "relay relay-y: its NATS connection is RECONNECTING",
		"Fleet throughput", ">312.6/s<",
		// the commands it suggests act on this outbox, outside the default schema: --schema
		"relay dead requeue --id ID --schema " + snap.Schema, "relay dead purge --id ID --schema " + snap.Schema,
		"relay dead show ID --schema " + snap.Schema} {
		if !strings.Contains(page, want) {
			t.Errorf("status page lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("the page:\n%s", page)
	}

	// The dead row's page: what an operator needs to decide, never the payload or header values.
	msg, code := testsvc.HTTPGet(t, base+"/messages/"+deadID.String())
	for _, want := range []string{deadID.String(), "orders.paid", "order-7", "dead", "nats: maximum payload exceeded",
		"relay dead requeue --id " + deadID.String() + " --schema " + snap.Schema, "relay dead purge --id " + deadID.String() + " --schema " + snap.Schema,
		"relay dead show " + deadID.String() + " --schema " + snap.Schema, "1 bytes"} {
		if code != 200 || !strings.Contains(msg, want) {
			t.Errorf("/messages/%s = %d, lacks %q:\n%s", deadID, code, want, msg)
		}
	}
	if _, code := testsvc.HTTPGet(t, base+"/messages/"+uuid.NewString()); code != 404 {
		t.Errorf("/messages/<unknown id> = %d, want 404", code)
	}
	if _, code := testsvc.HTTPGet(t, base+"/messages/not-an-id"); code != 400 {
		t.Errorf("/messages/not-an-id = %d, want 400", code)
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
	// Every command /status.json suggests (its problems and panel notes) names the schema.
	var cmds []string
	for _, text := range append(append([]string{}, js.Snapshot.Problems...), func() (notes []string) {
		for _, p := range js.Snapshot.Panels {
			notes = append(notes, p.Note)
		}
		return notes
	}()...) {
		for _, part := range strings.Split(text, "relay ")[1:] {
			for _, cmd := range []string{"dead ", "prepared ", "scheduled "} {
				if strings.HasPrefix(part, cmd) {
					cmds = append(cmds, "relay "+part)
					if !strings.Contains(part, "--schema "+snap.Schema) {
						t.Errorf("/status.json suggests a command without --schema %s: %q", snap.Schema, text)
					}
				}
			}
		}
	}
	if len(cmds) < 3 {
		t.Errorf("/status.json suggests %d commands, want the dead rows', the scheduled panel's and more: %q", len(cmds), cmds)
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

// The screenshot's size: the whole page.
const shotW, shotH = 1280, 1880

// The status page in a real browser: the screenshot shows the backlog bars in proportion, the
// dead-rows card in red and the six partitions the relay holds in its color.
func TestStatusPageInChromium(t *testing.T) {
	t.Parallel()
	bin := chromium(t)
	srv, _, deadID := pageEnv(t)
	url := "http://" + srv.Addr() + "/"

	dom := string(runChromium(t, bin, "--dump-dom", url))
	for _, want := range []string{"orders.created", "orders.paid", "relay-x", "Backlog by subject", "Partitions (8) and their holders",
		"Blocked keys", "order-7", `href="/messages/` + deadID.String() + `"`, `class="flagged"`, "RECONNECTING", "v1.3.2",
		"Scheduled (delayed) messages by subject", "orders.timeout"} {
		if !strings.Contains(dom, want) {
			t.Errorf("the DOM Chromium rendered lacks %q", want)
		}
	}
	// The blocked key's link leads to its dead row.
	msg := string(runChromium(t, bin, "--dump-dom", "http://"+srv.Addr()+"/messages/"+deadID.String()))
	for _, want := range []string{"relay dead requeue --id " + deadID.String(), "nats: maximum payload exceeded"} {
		if !strings.Contains(msg, want) {
			t.Errorf("the dead row's page in Chromium lacks %q", want)
		}
	}

	// TXOUTBOX_SCREENSHOT_DIR keeps the screenshot (the README's docs/status-page.png is made so).
	shot := filepath.Join(t.TempDir(), "status.png")
	if dir := os.Getenv("TXOUTBOX_SCREENSHOT_DIR"); dir != "" {
		shot = filepath.Join(dir, "status-page.png")
	}
	runChromium(t, bin, fmt.Sprintf("--window-size=%d,%d", shotW, shotH), "--screenshot="+shot, url)
	f, err := os.Open(shot)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() != shotW || b.Dy() != shotH {
		t.Fatalf("screenshot is %v, want %dx%d", b, shotW, shotH)
	}
	bar, dead, holder, flag := hexRGB(ColorBar), hexRGB(ColorDead), hexRGB(HolderColors[0]), hexRGB(ColorFlag)

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
	// What needs attention is marked in the flag color: relay-y's health and NATS pills, the
	// blocked keys' frame, the flagged producer group's edge. The flagged group's row comes
	// last on the page: the screenshot must reach it.
	flagPx := countNear(counts, flag)
	if flagPx < 1500 {
		t.Fatalf("%d pixels in the flag color, want the flagged relay, blocked keys and producer group (at least 1500)", flagPx)
	}
	t.Logf("screenshot %s: bars %v px, dead card %d px, held partition cells %d px, flagged %d px", shot, lengths, deadPx, cellPx, flagPx)
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
