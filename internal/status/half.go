package status

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/internal/cmdline"
	"github.com/txoutbox/txoutbox/internal/store"
)

// maxGroups bounds the half-message panel.
const maxGroups = 50

func init() {
	RegisterPanel(Panel{Name: "half messages", Collect: halfPanel})
}

// halfPanel shows the open half messages per producer group, when there are any: how many
// wait for their producer or the check-back, how old the oldest is, how many ran out of
// checks (check_exhausted: an operator's decision), and the group's last check error. A group
// whose last check found no responder (nobody serves its checker subject) is flagged, with
// that error, in the table and among the problems.
func halfPanel(ctx context.Context, db store.DBTX, q *store.Queries, _ *Snapshot) (*Table, error) {
	groups, err := q.HalfByGroup(ctx, db, maxGroups)
	if err != nil || len(groups) == 0 {
		return nil, err
	}
	t := &Table{
		Title:   "Half messages by producer group",
		Columns: []string{"GROUP", "PREPARED", "OLDEST PREPARED", "MOST CHECKS", "CHECK EXHAUSTED", "LAST CHECK ERROR"},
	}
	exhausted := false
	for i, g := range groups {
		name := g.Group
		if name == "" {
			name = "(none)"
		}
		lastErr := g.LastError
		if lastErr == "" {
			lastErr = "-"
		}
		t.Rows = append(t.Rows, []string{name, strconv.FormatInt(g.Prepared, 10), Age(g.OldestPrepared.Seconds(), g.Prepared),
			strconv.Itoa(int(g.MaxChecks)), strconv.FormatInt(g.Exhausted, 10), lastErr})
		exhausted = exhausted || g.Exhausted > 0
		if NoResponder(g.LastError) {
			t.Flagged = append(t.Flagged, i)
			t.Problems = append(t.Problems, noCheckerProblem(q.Schema, name, g))
		}
	}
	if exhausted {
		t.Note = "check_exhausted rows wait for you: " + cmdline.Command(q.Schema, "relay prepared list --state check_exhausted") + ", then resume, commit or rollback"
	}
	return t, nil
}

// noCheckerProblem is the problem line of a group whose last check found no checker, worded
// from its counts: the prepared half messages that will run out of checks unless its checker
// starts, and the check_exhausted ones that already did (an operator resumes them once it
// runs). name is the group as the panel shows it ("(none)" for no group).
func noCheckerProblem(schema, name string, g store.GroupHalf) string {
	s := fmt.Sprintf("producer group %s: its checks find no checker (%s)", name, g.LastError)
	if g.Prepared == 0 && g.Exhausted > 0 {
		resume := cmdline.Command(schema, "relay prepared list --state check_exhausted") + "`, then `" +
			cmdline.Command(schema, "relay prepared resume", "ID...")
		if g.Group != "" {
			resume = cmdline.Command(schema, "relay prepared resume --all --group", cmdline.ShellQuote(g.Group))
		}
		return s + fmt.Sprintf(", and its %s out of checks (check_exhausted): start the group's checker (checker.Serve), then resume %s: `%s`",
			plural(g.Exhausted, "half message ran", "half messages ran"), pick(g.Exhausted, "it", "them"), resume)
	}
	s += "; start the group's checker (checker.Serve)"
	if g.Prepared > 0 {
		s += fmt.Sprintf(", or its %s out of checks", plural(g.Prepared, "prepared half message runs", "prepared half messages run"))
		if g.Exhausted > 0 {
			s += fmt.Sprintf(" too, as %d already %s (check_exhausted)", g.Exhausted, pick(g.Exhausted, "has", "have"))
		}
	}
	return s
}

// NoResponder reports whether a check's recorded error (store.GroupHalf.LastError) says
// that nobody serves the group's checker subject.
func NoResponder(lastError string) bool {
	return strings.HasPrefix(lastError, checkback.OutcomeNoResponders+":")
}
