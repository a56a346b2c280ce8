package status

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/txoutbox/txoutbox/internal/cmdline"
	"github.com/txoutbox/txoutbox/internal/store"
)

func init() {
	RegisterPanel(Panel{Name: "scheduled messages", Collect: scheduledPanel})
}

// ScheduledLimit bounds the scheduled rows the panel reads on each snapshot (the first in due
// order, through the scheduled index), as --sample-limit bounds the relay's metrics: past it,
// counts read "at least".
const ScheduledLimit = 10_000

// OverdueAfter is how long past its delivery time a scheduled row may wait before the panel
// lists it under "Needs attention": a running relay promotes a due row within its poll
// interval (PollMax, 1s by default), so a row a minute late is not being promoted. The same
// threshold as the TxoutboxScheduledOverdue alert (deploy/prometheus/alerts.yml).
const OverdueAfter = time.Minute

// scheduledPanel shows the delayed messages waiting for their delivery time, per subject,
// when there are any: how many, how many are overdue, and when the first and last fall due.
// A row overdue by more than OverdueAfter is a problem (no relay is running, or its key is
// held by an open transaction): its subject is flagged and the snapshot's Problems say so. It
// reads the first ScheduledLimit rows in due order, however many wait.
func scheduledPanel(ctx context.Context, db store.DBTX, q *store.Queries, s *Snapshot) (*Table, error) {
	return scheduledTable(ctx, db, q, ScheduledLimit, s)
}

// Scheduled is the delayed messages' summary in a Snapshot (`relay status --json`,
// /status.json: "scheduled"). Due times are the later of a message's delivery time and when
// it was committed or last rescheduled (its transaction's start), as the relay's lateness.
type Scheduled struct {
	// Count is the scheduled messages counted: all of them when CountExact, else the first
	// ScheduledLimit in due order (there are more).
	Count      int64 `json:"count"`
	CountExact bool  `json:"count_exact"`
	// Overdue counts those past their delivery time (a running relay promotes them within its
	// poll interval).
	Overdue int64 `json:"overdue"`
	// NextDue is the earliest due time (null when nothing is scheduled); NextDueSeconds how
	// long until it, negative when it is past.
	NextDue        *time.Time `json:"next_due"`
	NextDueSeconds float64    `json:"next_due_seconds"`
	// LastDue is the latest due time of all scheduled messages (null when none).
	LastDue *time.Time `json:"last_due"`
	// Stuck is set when the earliest due message has waited more than OverdueAfter.
	Stuck    bool               `json:"stuck"`
	Subjects []ScheduledSubject `json:"subjects"`
}

// ScheduledSubject is one subject's share of Scheduled (of the messages counted).
type ScheduledSubject struct {
	Subject string    `json:"subject"`
	Count   int64     `json:"count"`
	Overdue int64     `json:"overdue"`
	NextDue time.Time `json:"next_due"`
	LastDue time.Time `json:"last_due"`
}

func scheduledTable(ctx context.Context, db store.DBTX, q *store.Queries, limit int, snap *Snapshot) (*Table, error) {
	st, err := q.ScheduledStatuses(ctx, db, limit)
	if err != nil || len(st.Subjects) == 0 {
		return nil, err
	}
	sum := &snap.Scheduled
	sum.Count, sum.CountExact = st.Counted, !st.Capped
	last := st.LastDue.UTC()
	sum.LastDue = &last
	t := &Table{
		Title:   "Scheduled (delayed) messages by subject",
		Columns: []string{"SUBJECT", "SCHEDULED", "OVERDUE", "NEXT DUE", "NEXT DUE AT", "LAST DUE AT"},
	}
	// count is n, or "at least n" when the rows were not all counted.
	count := func(n int64, exact bool) string {
		if exact {
			return strconv.FormatInt(n, 10)
		}
		return "at least " + strconv.FormatInt(n, 10)
	}
	now := time.Now()
	var overdue int64
	var first time.Time
	for i, s := range st.Subjects {
		last := s.LastDue.UTC().Format(time.RFC3339)
		if st.Capped {
			last = "at least " + last
		}
		t.Rows = append(t.Rows, []string{s.Subject, count(s.Count, !st.Capped), count(s.Overdue, s.Overdue < int64(limit)),
			Until(s.FirstDue, now), s.FirstDue.UTC().Format(time.RFC3339), last})
		if s.Overdue > 0 && now.Sub(s.FirstDue) > OverdueAfter {
			t.Flagged = append(t.Flagged, i)
		}
		overdue += s.Overdue
		if i == 0 || s.FirstDue.Before(first) {
			first = s.FirstDue
		}
		sum.Subjects = append(sum.Subjects, ScheduledSubject{Subject: s.Subject, Count: s.Count, Overdue: s.Overdue,
			NextDue: s.FirstDue.UTC(), LastDue: s.LastDue.UTC()})
	}
	next := first.UTC()
	sum.NextDue, sum.Overdue = &next, overdue
	sum.NextDueSeconds = untilSeconds(first, now)
	sum.Stuck = overdue > 0 && now.Sub(first) > OverdueAfter
	t.Rows = append(t.Rows, []string{"TOTAL", count(st.Counted, !st.Capped), count(overdue, overdue < int64(limit)),
		Until(first, now), first.UTC().Format(time.RFC3339), st.LastDue.UTC().Format(time.RFC3339)})
	t.Note = cmdline.Command(q.Schema, "relay scheduled list") + " shows them; " + cmdline.Command(q.Schema, "relay scheduled cancel", "ID") + " withdraws one"
	if st.Capped {
		t.Note = fmt.Sprintf("counted over the first %d in due order (subjects due only later are not listed); ", limit) + t.Note
	}
	if overdue > 0 {
		t.Note = "a running relay promotes overdue rows within its poll interval; rows that stay overdue mean no relay is running, " +
			"or their key is held by an open transaction (a producer's, or an uncommitted cancel). " + t.Note
	}
	if late := now.Sub(first); overdue > 0 && late > OverdueAfter {
		t.Problems = append(t.Problems, fmt.Sprintf("%s scheduled %s overdue, the oldest by %s: no relay is running, "+
			"or a key is held by an open transaction (see Oldest transactions; %s lists them, overdue first)",
			count(overdue, overdue < int64(limit)), pick(overdue, "row", "rows"), Age(late.Seconds(), 1), cmdline.Command(q.Schema, "relay scheduled list")))
	}
	return t, nil
}

// Until formats how long until t for people: "in 4m30s", or "overdue 2s". It counts in
// seconds, not with t.Sub, which saturates at about 292 years (a delivery time may lie up to
// 9999-12-31).
func Until(t, now time.Time) string {
	sec := untilSeconds(t, now)
	if sec < 0 {
		return "overdue " + Age(-sec, 1)
	}
	return "in " + Age(sec, 1)
}

// untilSeconds is how many seconds from now until t (negative when t is past), without
// time.Sub's saturation.
func untilSeconds(t, now time.Time) float64 {
	return float64(t.Unix()-now.Unix()) + float64(t.Nanosecond()-now.Nanosecond())/1e9
}
