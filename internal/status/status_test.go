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
	RegisterPanel(Panel{Name: "test", Collect: func(ctx context.Context, db store.DBTX, q *store.Queries) (*Table, error) {
		var n int
		if err := db.QueryRow(ctx, "SELECT count(*) FROM "+q.Messages).Scan(&n); err != nil {
			return nil, err
		}
		return &Table{Title: "Test panel", Columns: []string{"ROWS"}, Rows: [][]string{{strings.Repeat("#", n) + "|"}}, Note: "from a registered panel"}, nil
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
	for _, w := range []string{"live-1  alive", "dead-1  gone", "0-1", "TEST PANEL", "##|", "from a registered panel", "1 of 4 partitions have no holder"} {
		if !strings.Contains(out, w) {
			t.Errorf("text output lacks %q:\n%s", w, out)
		}
	}
}

func TestAgeAndRanges(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		sec  float64
		n    int64
		want string
	}{{0.25, 1, "250ms"}, {3.21, 1, "3.2s"}, {125, 1, "2m05s"}, {3*3600 + 60, 1, "3h01m"}, {50 * 3600, 1, "2d02h"}, {10, 0, "-"}} {
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
	}{
		{"payments", "prepared", "2 minutes", 3}, {"payments", "prepared", "1 minute", 1},
		{"payments", "check_exhausted", "1 hour", 15}, {"refunds", "prepared", "5 seconds", 0},
		{"refunds", "ready", "1 hour", 0}, // not a half message any more
	} {
		if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, producer_group, check_mode, check_count, created_at, next_check_at)
			VALUES ($1, 'orders.x', 1, '', $2, $3, 'checker', $4, now() - $5::interval, now())`, uuid.New(), r.state, r.group, r.checks, r.age); err != nil {
			t.Fatal(err)
		}
	}
	p := find()
	if p == nil {
		t.Fatal("no half-message panel")
	}
	got := make([]string, len(p.Rows))
	for i, row := range p.Rows {
		got[i] = strings.Join(row, " ")
	}
	if len(got) != 2 || !strings.HasPrefix(got[0], "payments 2 2m") || !strings.HasSuffix(got[0], " 3 1") ||
		!strings.HasPrefix(got[1], "refunds 1 ") || !strings.HasSuffix(got[1], " 0 0") || !strings.Contains(p.Note, "check_exhausted") {
		t.Fatalf("panel rows %q, note %q", got, p.Note)
	}
}
