package status

import (
	"context"
	"strconv"
	"time"

	"github.com/txoutbox/txoutbox/internal/store"
)

func init() {
	RegisterPanel(Panel{Name: "scheduled messages", Collect: scheduledPanel})
}

// scheduledPanel shows the delayed messages waiting for their delivery time, per subject,
// when there are any: how many, how many are overdue (a relay promotes them within its poll
// interval; many overdue means none runs), and when the first and last fall due.
func scheduledPanel(ctx context.Context, db store.DBTX, q *store.Queries) (*Table, error) {
	subjects, err := q.ScheduledStatuses(ctx, db)
	if err != nil || len(subjects) == 0 {
		return nil, err
	}
	t := &Table{
		Title:   "Scheduled (delayed) messages by subject",
		Columns: []string{"SUBJECT", "SCHEDULED", "OVERDUE", "NEXT DUE", "NEXT DUE AT", "LAST DUE AT"},
	}
	now := time.Now()
	var total, overdue int64
	var first, last time.Time
	for i, s := range subjects {
		t.Rows = append(t.Rows, []string{s.Subject, strconv.FormatInt(s.Count, 10), strconv.FormatInt(s.Overdue, 10),
			Until(s.FirstDue, now), s.FirstDue.UTC().Format(time.RFC3339), s.LastDue.UTC().Format(time.RFC3339)})
		total += s.Count
		overdue += s.Overdue
		if i == 0 || s.FirstDue.Before(first) {
			first = s.FirstDue
		}
		if s.LastDue.After(last) {
			last = s.LastDue
		}
	}
	t.Rows = append(t.Rows, []string{"TOTAL", strconv.FormatInt(total, 10), strconv.FormatInt(overdue, 10),
		Until(first, now), first.UTC().Format(time.RFC3339), last.UTC().Format(time.RFC3339)})
	t.Note = "relay scheduled list shows them; relay scheduled cancel withdraws one"
	if overdue > 0 {
		t.Note = "overdue rows are published at a relay's next pass; if they stay, no relay is running. " + t.Note
	}
	return t, nil
}

// Until formats how long until t for people: "in 4m30s", or "overdue 2s". It counts in
// seconds, not with t.Sub, which saturates at about 292 years (a delivery time may lie up to
// 9999-12-31).
func Until(t, now time.Time) string {
	sec := float64(t.Unix()-now.Unix()) + float64(t.Nanosecond()-now.Nanosecond())/1e9
	if sec < 0 {
		return "overdue " + Age(-sec, 1)
	}
	return "in " + Age(sec, 1)
}
