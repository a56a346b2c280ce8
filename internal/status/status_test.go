package status

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

func TestMain(m *testing.M) { os.Exit(testsvc.Main(m)) }

func init() {
	// The wiring point other subsystems use: a panel shows up in every snapshot.
	RegisterPanel(Panel{Name: "test", Collect: func(ctx context.Context, db store.DBTX, q *store.Queries, _ *Snapshot) (*Table, error) {
		var n int
		if err := db.QueryRow(ctx, "SELECT count(*) FROM "+q.Messages).Scan(&n); err != nil {
			return nil, err
		}
		return &Table{Title: "Test panel", Columns: []string{"ROWS"}, Rows: [][]string{{strings.Repeat("#", n) + "|"}}, Note: "from a registered panel"}, nil
	}})
	// A warning: a panel with problems only.
	RegisterPanel(Panel{Name: "test warning", Collect: func(context.Context, store.DBTX, *store.Queries, *Snapshot) (*Table, error) {
		return &Table{Problems: []string{"warning from a problems-only panel"}}, nil
	}})
}

// Holders come from pg_locks: a registered relay, a relay that is gone, and a session that
// holds a partition lock without being registered.
func TestCollectRelaysAndHolders(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	q := store.New(db.Schema)
	live, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer live.Release()
	stranger, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer stranger.Release()
	if err := q.RegisterRelay(ctx, live, store.RelayRegistration{Instance: uuid.New(), RelayID: "live-1", Partitions: 4, LeaseInterval: time.Second}); err != nil {
		t.Fatal(err)
	}
	if _, err := q.TryLockPartitions(ctx, live, []int32{0, 1}); err != nil {
		t.Fatal(err)
	}
	defer q.UnlockPartitions(ctx, live, []int32{0, 1})
	if _, err := q.TryLockPartitions(ctx, stranger, []int32{3}); err != nil {
		t.Fatal(err)
	}
	defer q.UnlockPartitions(ctx, stranger, []int32{3})
	// A relay whose session is gone (pid 0 never exists).
	if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_relays (instance, relay_id, backend_pid, partitions, lease_interval_ms, heartbeat_at)
		VALUES ($1, 'dead-1', 0, 4, 1000, now() - interval '5 seconds')`, uuid.New()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload) VALUES ($1, 'a.b', 6, ''), ($2, 'a.b', 7, '')`,
		uuid.New(), uuid.New()); err != nil {
		t.Fatal(err)
	}

	s, err := Collect(ctx, db.Pool, q, &Options{Partitions: 16})
	if err != nil {
		t.Fatal(err)
	}
	if s.Partitions != 4 {
		t.Fatalf("partitions = %d, want the live relay's 4 (not the default)", s.Partitions)
	}
	if len(s.Relays) != 2 || s.Relays[0].RelayID != "live-1" || !s.Relays[0].Alive || s.Relays[1].Alive || len(s.Relays[0].Held) != 2 {
		t.Fatalf("relays = %+v", s.Relays)
	}
	want := []string{"live-1", "live-1", "", "pid"}
	for i, p := range s.Partition {
		if !strings.HasPrefix(p.Holder, want[i]) || (want[i] == "" && p.Holder != "") {
			t.Errorf("partition %d holder %q, want %q", i, p.Holder, want[i])
		}
	}
	if s.Partition[2].Ready != 1 || s.Partition[3].Ready != 1 { // 6 % 4 = 2, 7 % 4 = 3
		t.Errorf("partition backlog = %+v", s.Partition)
	}
	if len(s.Panels) != 1 || s.Panels[0].Rows[0][0] != "##|" {
		t.Fatalf("panels = %+v", s.Panels)
	}
	var buf bytes.Buffer
	if err := WriteText(&buf, s); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, w := range []string{"live-1  alive", "dead-1  gone", "0-1", "TEST PANEL", "##|", "from a registered panel", "1 of 4 partitions has no holder"} {
		if !strings.Contains(out, w) {
			t.Errorf("text output lacks %q:\n%s", w, out)
		}
	}
}

// Until counts in seconds, not with time.Time.Sub, which saturates at 292 years.
func TestUntilFarAhead(t *testing.T) {
	t.Parallel()
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		at   time.Time
		want string
	}{
		{time.Date(2400, 1, 1, 0, 0, 0, 0, time.UTC), "in 136965d00h"},
		{time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC), "in 2912807d23h"},
		{now.Add(90 * time.Second), "in 1m30s"},
		{now.Add(-2 * time.Second), "overdue 2.0s"},
		{time.Date(1970, 1, 1, 0, 0, 0, 0, time.UTC), "overdue 20089d00h"},
	} {
		if got := Until(c.at, now); got != c.want {
			t.Errorf("Until(%v) = %q, want %q", c.at, got, c.want)
		}
	}
}

func TestAgeAndRanges(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		sec  float64
		n    int64
		want string
	}{{0.25, 1, "250ms"}, {3.21, 1, "3.2s"}, {125, 1, "2m05s"}, {3*3600 + 60, 1, "3h01m"}, {50 * 3600, 1, "2d02h"}, {10, 0, "-"},
		// Past the range of a time.Duration (292 years): a delivery time up to 9999-12-31.
		{400 * 365 * 86400, 1, "146000d00h"}, {-3, 1, "0ms"}} {
		if got := Age(c.sec, c.n); got != c.want {
			t.Errorf("Age(%v, %d) = %q, want %q", c.sec, c.n, got, c.want)
		}
	}
	for in, want := range map[string]string{"": "-", "0": "0", "0,1,2,3,5,7,8": "0-3,5,7-8"} {
		var ps []int32
		for _, x := range strings.Split(in, ",") {
			if x != "" {
				var v int32
				for _, ch := range x {
					v = v*10 + int32(ch-'0')
				}
				ps = append(ps, v)
			}
		}
		if got := Ranges(ps); got != want {
			t.Errorf("Ranges(%v) = %q, want %q", ps, got, want)
		}
	}
}

// Open half messages show up per producer group, with a note when some ran out of checks.
func TestHalfMessagePanel(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	q := store.New(db.Schema)
	find := func() *Table {
		s, err := Collect(ctx, db.Pool, q, nil)
		if err != nil {
			t.Fatal(err)
		}
		for i := range s.Panels {
			if s.Panels[i].Title == "Half messages by producer group" {
				return &s.Panels[i]
			}
		}
		return nil
	}
	if p := find(); p != nil {
		t.Fatalf("panel shown with no half messages: %+v", p)
	}
	for _, r := range []struct {
		group, state, age string
		checks            int
		lastErr           string
	}{
		{"payments", "prepared", "2 minutes", 3, "no_responders: no checker serves txoutbox.check.payments"},
		{"payments", "prepared", "1 minute", 1, "timeout: no answer from txoutbox.check.payments within 3s"},
		{"payments", "check_exhausted", "1 hour", 15, "unknown: checker answered UNKNOWN"},
		{"refunds", "prepared", "5 seconds", 0, ""},
		{"refunds", "ready", "1 hour", 0, ""}, // not a half message any more
	} {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, producer_group, check_mode, check_count, created_at, next_check_at, last_error)
			VALUES ($1, 'orders.x', 1, '', $2, $3, 'checker', $4, now() - $5::interval, now(), nullif($6, ''))`, uuid.New(), r.state, r.group, r.checks, r.age, r.lastErr); err != nil {
			t.Fatal(err)
		}
	}
	p := find()
	if p == nil {
		t.Fatal("no half-message panel")
	}
	got := make([]string, len(p.Rows))
	for i, row := range p.Rows {
		got[i] = strings.Join(row, "|")
	}
	// payments: the last check error is that of its prepared row with the most checks (no
	// responders), which flags the group; refunds has never been checked.
	if len(got) != 2 || !strings.HasPrefix(got[0], "payments|2|2m") || !strings.HasSuffix(got[0], "|3|1|no_responders: no checker serves txoutbox.check.payments") ||
		!strings.HasPrefix(got[1], "refunds|1|") || !strings.HasSuffix(got[1], "|0|0|-") || !strings.Contains(p.Note, "check_exhausted") {
		t.Fatalf("panel rows %q, note %q", got, p.Note)
	}
	if len(p.Flagged) != 1 || p.Flagged[0] != 0 {
		t.Fatalf("flagged rows %v, want [0] (payments)", p.Flagged)
	}
	s, err := Collect(ctx, db.Pool, q, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !containsLine(s.Problems, "producer group payments: its checks find no checker (no_responders: no checker serves txoutbox.check.payments)") ||
		containsLine(s.Problems, "producer group refunds") {
		t.Fatalf("problems %q, want payments flagged (and refunds not)", s.Problems)
	}
	// Once a check of the group gets an answer again (here: a timeout), the flag goes.
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET last_error = 'timeout: no answer' WHERE last_error LIKE 'no_responders:%'`); err != nil {
		t.Fatal(err)
	}
	if p := find(); len(p.Flagged) != 0 {
		t.Fatalf("flagged rows %v after the checker answered", p.Flagged)
	}
}

func containsLine(lines []string, sub string) bool {
	for _, l := range lines {
		if strings.Contains(l, sub) {
			return true
		}
	}
	return false
}

// Rows held back by a dead row of their key: the key, how many wait, and the dead row (the
// key's first). A dead row with nothing behind it blocks nothing; a ready row before a dead
// row of its key is not held back; unkeyed dead rows hold back nothing.
func TestBlockedKeys(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	q := store.New(db.Schema)
	ids := map[string]uuid.UUID{}
	for _, r := range []struct{ name, key, state string }{
		{"k1-early", "k1", "ready"}, // before the dead row: not held back
		{"k1-dead", "k1", "dead"},
		{"k1-dead2", "k1", "dead"}, // a second dead row of k1: the first is the one shown
		{"k1-a", "k1", "ready"},
		{"k1-b", "k1", "ready"},
		{"k1-c", "k1", "ready"},
		{"k2-dead", "k2", "dead"},
		{"k2-a", "k2", "ready"},
		{"k3-dead", "k3", "dead"}, // nothing behind it
		{"free", "k4", "ready"},
		{"unkeyed-dead", "", "dead"},
		{"unkeyed", "", "ready"},
	} {
		ids[r.name] = uuid.New()
		attempts := 0
		if r.state == "dead" {
			attempts = 20
		}
		if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, msg_key, partition_key, payload, state, attempts, last_error)
			VALUES ($1, 'orders.' || $2, nullif($3, ''), 1, '', $4, $5, CASE WHEN $4 = 'dead' THEN 'stream refused: message too large' END)`,
			ids[r.name], r.name, r.key, r.state, attempts); err != nil {
			t.Fatal(err)
		}
	}
	s, err := Collect(ctx, db.Pool, q, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Blocked) != 2 {
		t.Fatalf("blocked keys %+v, want k1 and k2", s.Blocked)
	}
	b := s.Blocked[0]
	if b.Key != "k1" || b.Ready != 3 || b.DeadMessageID != ids["k1-dead"] || b.DeadSubject != "orders.k1-dead" || b.DeadAttempts != 20 ||
		b.DeadLastError != "stream refused: message too large" {
		t.Fatalf("first blocked key %+v, want k1 with 3 ready behind k1-dead", b)
	}
	if b := s.Blocked[1]; b.Key != "k2" || b.Ready != 1 || b.DeadMessageID != ids["k2-dead"] {
		t.Fatalf("second blocked key %+v, want k2 with 1 ready", b)
	}
	if s.Totals.Blocked != 4 || s.Totals.Dead != 5 {
		t.Fatalf("totals %+v, want 4 blocked and 5 dead", s.Totals)
	}
	if !containsLine(s.Problems, "5 dead rows: 4 ready rows of 2 keys wait behind them") {
		t.Fatalf("problems %q", s.Problems)
	}
	var buf bytes.Buffer
	if err := WriteText(&buf, s); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"BLOCKED KEY", "k1  ", ids["k1-dead"].String(), "stream refused: message too large", "5 dead (holding back 4 ready)"} {
		if !strings.Contains(buf.String(), w) {
			t.Errorf("text output lacks %q:\n%s", w, buf.String())
		}
	}
}

// The fleet: what each relay reported with its heartbeat (version, health, NATS connection,
// throughput) for every live relay, the live relays' rates added up, and a relay whose NATS
// connection is down among the problems.
func TestFleet(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	q := store.New(db.Schema)
	for _, r := range []store.RelayRegistration{
		{Instance: uuid.New(), RelayID: "relay-a", Partitions: 8, LeaseInterval: time.Second,
			RelayInfo: store.RelayInfo{Version: "v1.4.0", Health: "ok", NATS: "CONNECTED", Published: 1200, PublishRate: 40.5}},
		{Instance: uuid.New(), RelayID: "relay-b", Partitions: 8, LeaseInterval: time.Second,
			RelayInfo: store.RelayInfo{Version: "v1.3.2", Health: "nats_unavailable", NATS: "RECONNECTING", Published: 7, PublishRate: 0.5}},
	} {
		conn, err := db.Pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Release()
		if err := q.RegisterRelay(ctx, conn, r); err != nil {
			t.Fatal(err)
		}
	}
	s, err := Collect(ctx, db.Pool, q, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Relays) != 2 {
		t.Fatalf("relays %+v", s.Relays)
	}
	byID := map[string]Relay{}
	for _, r := range s.Relays {
		byID[r.RelayID] = r
	}
	if a := byID["relay-a"]; !a.Alive || a.Version != "v1.4.0" || a.Health != "ok" || a.NATS != "CONNECTED" || a.Published != 1200 || a.PublishRate != 40.5 {
		t.Fatalf("relay-a %+v", a)
	}
	if b := byID["relay-b"]; !b.Alive || b.Version != "v1.3.2" || b.NATS != "RECONNECTING" {
		t.Fatalf("relay-b %+v", b)
	}
	// The same from SQL (migration 006's txoutbox_relay_fleet()).
	var fleet []string
	rows, err := db.Pool.Query(ctx, `SELECT relay_id || ' ' || alive || ' ' || nats_state || ' ' || version FROM txoutbox_relay_fleet()`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		fleet = append(fleet, line)
	}
	if rows.Err() != nil || len(fleet) != 2 || fleet[0] != "relay-a true CONNECTED v1.4.0" || fleet[1] != "relay-b true RECONNECTING v1.3.2" {
		t.Fatalf("txoutbox_relay_fleet() = %q, %v", fleet, rows.Err())
	}
	if s.Totals.PublishRate != 41 {
		t.Fatalf("fleet publish rate %v, want 41", s.Totals.PublishRate)
	}
	if !containsLine(s.Problems, "relay relay-b: its NATS connection is RECONNECTING") || containsLine(s.Problems, "relay relay-a") {
		t.Fatalf("problems %q", s.Problems)
	}
	var buf bytes.Buffer
	if err := WriteText(&buf, s); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"NATS", "VERSION", "v1.4.0", "RECONNECTING", "40.5", "relays publish 41.0/s"} {
		if !strings.Contains(buf.String(), w) {
			t.Errorf("text output lacks %q:\n%s", w, buf.String())
		}
	}
}

// A panel's problems join the snapshot's, and a panel with problems only adds no table.
func TestPanelProblems(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	s, err := Collect(context.Background(), db.Pool, store.New(db.Schema), nil)
	if err != nil {
		t.Fatal(err)
	}
	if !containsLine(s.Problems, "warning from a problems-only panel") {
		t.Fatalf("problems %q", s.Problems)
	}
	for _, p := range s.Panels {
		if len(p.Columns) == 0 {
			t.Fatalf("a panel without columns is shown: %+v", p)
		}
	}
}
