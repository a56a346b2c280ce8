package status

import (
	"context"
	"strconv"

	"github.com/txoutbox/txoutbox/internal/store"
)

// maxGroups bounds the half-message panel.
const maxGroups = 50

func init() {
	RegisterPanel(Panel{Name: "half messages", Collect: halfPanel})
}

// halfPanel shows the open half messages per producer group, when there are any: how many
// wait for their producer or the check-back, how old the oldest is, and how many ran out of
// checks (check_exhausted: an operator's decision).
func halfPanel(ctx context.Context, db store.DBTX, q *store.Queries) (*Table, error) {
	groups, err := q.HalfByGroup(ctx, db, maxGroups)
	if err != nil || len(groups) == 0 {
		return nil, err
	}
	t := &Table{
		Title:   "Half messages by producer group",
		Columns: []string{"GROUP", "PREPARED", "OLDEST PREPARED", "MOST CHECKS", "CHECK EXHAUSTED"},
	}
	exhausted := false
	for _, g := range groups {
		name := g.Group
		if name == "" {
			name = "(none)"
		}
		t.Rows = append(t.Rows, []string{name, strconv.FormatInt(g.Prepared, 10), Age(g.OldestPrepared.Seconds(), g.Prepared),
			strconv.Itoa(int(g.MaxChecks)), strconv.FormatInt(g.Exhausted, 10)})
		exhausted = exhausted || g.Exhausted > 0
	}
	if exhausted {
		t.Note = "check_exhausted rows wait for you: relay prepared list --state check_exhausted, then resume, commit or rollback"
	}
	return t, nil
}
