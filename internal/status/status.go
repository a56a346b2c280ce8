// Package status builds the operator's view of an outbox: backlog per subject and partition,
// dead and prepared rows, relays and the partitions they hold. `relay status` prints it and the
// relay's status page (package ops) renders it.
//
// Extra sections are panels added with RegisterPanel from an init function; this package
// registers one, the open half messages per producer group (half.go). `relay status` and the
// status page show every panel. A panel is also the way to add a warning: the Problems of the
// Table it returns join the snapshot's Problems (the page's "Needs attention"), and a panel
// may return a Table with Problems only (no Columns), which shows nowhere else.
package status

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/txoutbox/txoutbox/internal/cmdline"
	"github.com/txoutbox/txoutbox/internal/store"
)

// Snapshot is the state of one outbox at one moment.
type Snapshot struct {
	Schema string    `json:"schema"`
	At     time.Time `json:"at"`
	// Partitions is the partition count of the live relays (or the caller's default when none
	// is alive).
	Partitions int       `json:"partitions"`
	Totals     Totals    `json:"totals"`
	Subjects   []Subject `json:"subjects"`
	// Blocked are the keys whose ready rows wait behind a dead row of the same key (the
	// maxBlocked with the most rows waiting).
	Blocked   []store.BlockedKey `json:"blocked"`
	Relays    []Relay            `json:"relays"`
	Partition []Partition        `json:"partition_table"`
	Panels    []Table            `json:"panels"`
	// Scheduled sums up the delayed messages (the scheduled-messages panel shows them per
	// subject), as typed values for scripts.
	Scheduled Scheduled `json:"scheduled"`
	// Problems are things an operator should look at, in plain words.
	Problems []string `json:"problems"`
}

// Totals add up the subjects.
type Totals struct {
	Ready              int64   `json:"ready"`
	Due                int64   `json:"due"`
	Retrying           int64   `json:"retrying"`
	Dead               int64   `json:"dead"`
	Prepared           int64   `json:"prepared"`
	CheckExhausted     int64   `json:"check_exhausted"`
	OldestReadySeconds float64 `json:"oldest_ready_seconds"`
	// Blocked counts the ready rows held back by a dead row of their key (in the keys of
	// Snapshot.Blocked).
	Blocked int64 `json:"blocked"`
	// PublishRate adds up the live relays' publish rates (rows per second over about the
	// last minute, from their heartbeats).
	PublishRate float64 `json:"publish_rate"`
}

// Subject is one subject's unpublished rows.
type Subject struct {
	store.SubjectStatus
	OldestReadySeconds float64 `json:"oldest_ready_seconds"`
}

// Relay is a relay of the membership table.
type Relay struct {
	store.RelayMember
	LastSeenSeconds float64 `json:"last_seen_seconds"`
	Held            []int32 `json:"held"`
}

// Partition is one partition: its holder and its ready backlog.
type Partition struct {
	Partition int32 `json:"partition"`
	// Holder is the relay id of the holder, "" when nobody holds it.
	Holder             string  `json:"holder"`
	HolderPID          int32   `json:"holder_pid"` // 0 when nobody holds it
	Ready              int64   `json:"ready"`
	OldestReadySeconds float64 `json:"oldest_ready_seconds"`
}

// Table is a panel's content: a titled table.
type Table struct {
	Title   string     `json:"title"`
	Columns []string   `json:"columns"`
	Rows    [][]string `json:"rows"`
	// Note is a line under the table (what the numbers mean, what to do).
	Note string `json:"note"`
	// Flagged are the indexes of the rows that need attention (shown highlighted).
	Flagged []int `json:"flagged"`
	// Problems are added to the snapshot's Problems.
	Problems []string `json:"-"`
	// Warning, when set, is also listed among the snapshot's Problems.
	Warning string `json:"warning,omitempty"`
}

// maxBlocked bounds the blocked keys a snapshot lists.
const maxBlocked = 20

// Panel is an extra section. Collect runs on every snapshot; keep it to cheap queries.
type Panel struct {
	Name string
	// Collect returns the panel's table (nil: nothing to show). It may also set the typed
	// fields of s that belong to it.
	Collect func(ctx context.Context, db store.DBTX, q *store.Queries, s *Snapshot) (*Table, error)
}

var (
	panelsMu sync.Mutex
	panels   []Panel
)

// RegisterPanel adds a panel to every snapshot (call it from an init function).
func RegisterPanel(p Panel) {
	panelsMu.Lock()
	defer panelsMu.Unlock()
	panels = append(panels, p)
}

func registered() []Panel {
	panelsMu.Lock()
	defer panelsMu.Unlock()
	return append([]Panel(nil), panels...)
}

// Options tune Collect.
type Options struct {
	// Partitions is the partition count to group the backlog by when no relay is alive to
	// tell it. Defaults to 8 (the relay's default).
	Partitions int
}

// Collect reads a snapshot of the outbox in schema q.Schema.
func Collect(ctx context.Context, db store.DBTX, q *store.Queries, opts *Options) (*Snapshot, error) {
	s := &Snapshot{Schema: q.Schema, At: time.Now()}
	subjects, err := q.SubjectStatuses(ctx, db)
	if err != nil {
		return nil, fmt.Errorf("status: subjects: %w", err)
	}
	for _, st := range subjects {
		sub := Subject{SubjectStatus: st, OldestReadySeconds: st.OldestReady.Seconds()}
		s.Subjects = append(s.Subjects, sub)
		s.Totals.Ready += st.Ready
		s.Totals.Due += st.Due
		s.Totals.Retrying += st.Retrying
		s.Totals.Dead += st.Dead
		s.Totals.Prepared += st.Prepared
		s.Totals.CheckExhausted += st.CheckExhausted
		s.Totals.OldestReadySeconds = max(s.Totals.OldestReadySeconds, sub.OldestReadySeconds)
	}

	if s.Blocked, err = q.BlockedKeys(ctx, db, maxBlocked); err != nil {
		return nil, fmt.Errorf("status: blocked keys: %w", err)
	}
	for _, b := range s.Blocked {
		s.Totals.Blocked += b.Ready
	}

	view, err := q.Membership(ctx, db, nil)
	if err != nil {
		return nil, fmt.Errorf("status: relays: %w", err)
	}
	s.Partitions = 8
	if opts != nil && opts.Partitions > 0 {
		s.Partitions = opts.Partitions
	}
	counts := map[int]int{}
	for _, m := range view.Members {
		if m.Alive {
			counts[m.Partitions]++
		}
	}
	if len(counts) > 0 {
		best := 0
		for n, c := range counts {
			if c > counts[best] || (c == counts[best] && n > best) {
				best = n
			}
		}
		s.Partitions = best
	}
	if len(counts) > 1 {
		s.Problems = append(s.Problems, fmt.Sprintf("live relays disagree on the partition count (%v relays per count); stop the odd ones", counts))
	}
	byPID := map[int32]int{}
	for _, m := range view.Members {
		r := Relay{RelayMember: m, LastSeenSeconds: s.At.Sub(m.HeartbeatAt).Seconds()}
		if m.Alive {
			byPID[m.PID] = len(s.Relays)
			s.Totals.PublishRate += m.PublishRate
		}
		s.Relays = append(s.Relays, r)
	}
	holder := map[int32]store.PartitionLock{}
	for _, l := range view.Locks {
		holder[l.Partition] = l
		if i, ok := byPID[l.PID]; ok {
			s.Relays[i].Held = append(s.Relays[i].Held, l.Partition)
		}
	}

	backlog, err := q.PartitionBacklog(ctx, db, s.Partitions)
	if err != nil {
		return nil, fmt.Errorf("status: partitions: %w", err)
	}
	byPart := map[int32]store.PartitionSample{}
	for _, b := range backlog {
		byPart[b.Partition] = b
	}
	unheld := 0
	for p := int32(0); p < int32(s.Partitions); p++ {
		row := Partition{Partition: p, Ready: byPart[p].Ready, OldestReadySeconds: byPart[p].Oldest.Seconds()}
		if l, ok := holder[p]; ok {
			row.HolderPID = l.PID
			if i, ok := byPID[l.PID]; ok {
				row.Holder = s.Relays[i].RelayID
			} else {
				row.Holder = fmt.Sprintf("pid %d (not a registered relay)", l.PID)
			}
		} else {
			unheld++
		}
		s.Partition = append(s.Partition, row)
	}
	alive := len(byPID)
	switch {
	case alive == 0 && s.Totals.Ready > 0:
		s.Problems = append(s.Problems, fmt.Sprintf("no relay is running and %s to be published", plural(s.Totals.Ready, "row waits", "rows wait")))
	case alive > 0 && unheld > 0:
		s.Problems = append(s.Problems, fmt.Sprintf("%d of %s no holder (a relay just died or joined: %s taken within a lease interval)",
			unheld, plural(s.Partitions, "partition has", "partitions "+pick(unheld, "has", "have")), pick(unheld, "it is", "they are")))
	}
	switch {
	case len(s.Blocked) > 0:
		s.Problems = append(s.Problems, fmt.Sprintf("%s: %s of %s %s behind %s (see Blocked keys); "+
			"`%s` a row, then requeue or purge it", plural(s.Totals.Dead, "dead row", "dead rows"), plural(s.Totals.Blocked, "ready row", "ready rows"),
			plural(len(s.Blocked), "key", "keys"), pick(s.Totals.Blocked, "waits", "wait"), pick(s.Totals.Dead, "it", "them"), cmdline.Command(s.Schema, "relay dead show", "ID")))
	case s.Totals.Dead > 0:
		s.Problems = append(s.Problems, fmt.Sprintf("%s: see `%s`, then requeue or purge %s", plural(s.Totals.Dead, "dead row holds back its key", "dead rows hold back their keys"),
			cmdline.Command(s.Schema, "relay dead list"), pick(s.Totals.Dead, "it", "them")))
	}
	for _, r := range s.Relays {
		if r.Alive && r.NATS != "" && r.NATS != "CONNECTED" {
			s.Problems = append(s.Problems, fmt.Sprintf("relay %s: its NATS connection is %s", r.RelayID, r.NATS))
		}
	}
	if s.Totals.CheckExhausted > 0 {
		s.Problems = append(s.Problems, fmt.Sprintf("%s out of check-backs: see `%s`", plural(s.Totals.CheckExhausted, "half message ran", "half messages ran"),
			cmdline.Command(s.Schema, "relay prepared list --state check_exhausted")))
	}

	s.Scheduled.CountExact = true // nothing scheduled until the panel counts
	for _, p := range registered() {
		t, err := p.Collect(ctx, db, q, s)
		if err != nil {
			s.Problems = append(s.Problems, fmt.Sprintf("panel %s: %v", p.Name, err))
			continue
		}
		if t != nil {
			s.Problems = append(s.Problems, t.Problems...)
			if t.Warning != "" {
				s.Problems = append(s.Problems, t.Warning)
			}
			if len(t.Columns) > 0 {
				s.Panels = append(s.Panels, *t)
			}
		}
	}
	sort.SliceStable(s.Relays, func(i, j int) bool { return s.Relays[i].Alive && !s.Relays[j].Alive })
	s.emptyLists()
	return s, nil
}

// emptyLists makes every nil list of s empty, so that JSON has [] where there is nothing
// (never null): `relay status --json` and /status.json.
func (s *Snapshot) emptyLists() {
	nonNil := func(p *[]string) {
		if *p == nil {
			*p = []string{}
		}
	}
	if s.Subjects == nil {
		s.Subjects = []Subject{}
	}
	if s.Blocked == nil {
		s.Blocked = []store.BlockedKey{}
	}
	if s.Relays == nil {
		s.Relays = []Relay{}
	}
	for i := range s.Relays {
		if s.Relays[i].Held == nil {
			s.Relays[i].Held = []int32{}
		}
	}
	if s.Partition == nil {
		s.Partition = []Partition{}
	}
	if s.Panels == nil {
		s.Panels = []Table{}
	}
	for i := range s.Panels {
		nonNil(&s.Panels[i].Columns)
		if s.Panels[i].Rows == nil {
			s.Panels[i].Rows = [][]string{}
		}
		if s.Panels[i].Flagged == nil {
			s.Panels[i].Flagged = []int{}
		}
	}
	nonNil(&s.Problems)
	if s.Scheduled.Subjects == nil {
		s.Scheduled.Subjects = []ScheduledSubject{}
	}
}

// plural is n and one (1 row), or n and many (0 rows, 2 rows).
func plural[N ~int | ~int64](n N, one, many string) string {
	return fmt.Sprintf("%d %s", n, pick(n, one, many))
}

// pick is one when n is 1, else many: the word that goes with a count printed elsewhere.
func pick[N ~int | ~int64](n N, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
