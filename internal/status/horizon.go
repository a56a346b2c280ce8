package status

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/txoutbox/txoutbox/internal/store"
)

// HorizonWarnAfter is the age from which an open transaction (or a prepared one) holding back
// PostgreSQL's xmin horizon is a problem on the status page: past it, the rows the relay
// settles cannot be vacuumed and every claim walks past more of them.
const HorizonWarnAfter = time.Minute

func init() {
	RegisterPanel(Panel{Name: "xmin horizon", Collect: func(ctx context.Context, db store.DBTX, q *store.Queries, _ *Snapshot) (*Table, error) {
		return horizonPanel(ctx, db, q, HorizonWarnAfter)
	}})
}

// horizonPanel shows what holds back the xmin horizon when it is older than warnAfter, with
// a warning naming the oldest transaction's age, pid, application_name and state (never its
// query); nothing otherwise.
func horizonPanel(ctx context.Context, db store.DBTX, q *store.Queries, warnAfter time.Duration) (*Table, error) {
	h, err := q.XminHorizon(ctx, db)
	if err != nil {
		return nil, err
	}
	w := horizonWarning(h, warnAfter)
	if w == "" {
		return nil, nil
	}
	t := &Table{
		Title:   "Oldest transactions (xmin horizon)",
		Columns: []string{"HOLDER", "AGE", "XMIN AGE (XIDS)", "DETAIL"},
		Warning: w,
		Note: "while these stay open VACUUM cannot remove the outbox rows the relay settled; end the session " +
			"(pg_terminate_backend(pid)) or finish the prepared transaction",
	}
	if h.OldestXact > 0 {
		t.Rows = append(t.Rows, []string{"session pid " + strconv.Itoa(int(h.OldestPID)), Age(h.OldestXact.Seconds(), 1),
			strconv.FormatInt(h.XactXminAge, 10), fmt.Sprintf("application_name %q, %s", h.OldestApp, h.OldestState)})
	}
	if h.Prepared > 0 {
		t.Rows = append(t.Rows, []string{plural(h.Prepared, "prepared transaction", "prepared transactions"), Age(h.OldestPrepared.Seconds(), 1),
			strconv.FormatInt(h.PreparedXminAge, 10), "see pg_prepared_xacts"})
	}
	if h.SlotXminAge > 0 {
		t.Rows = append(t.Rows, []string{"replication slots", "-", strconv.FormatInt(h.SlotXminAge, 10), "see pg_replication_slots"})
	}
	return t, nil
}

// horizonWarning is the status page's problem line for h, or "" when nothing is older than
// warnAfter.
func horizonWarning(h store.Horizon, warnAfter time.Duration) string {
	switch {
	case h.OldestXact > 0 && h.OldestXact >= warnAfter:
		return fmt.Sprintf("a transaction has been open for %s (pid %d, application_name %q, %s): it holds back the xmin horizon, so VACUUM cannot remove settled outbox rows and claims slow down",
			Age(h.OldestXact.Seconds(), 1), h.OldestPID, h.OldestApp, h.OldestState)
	case h.Prepared > 0 && h.OldestPrepared >= warnAfter:
		if h.Prepared == 1 {
			return fmt.Sprintf("1 prepared transaction, prepared %s ago, holds back the xmin horizon: COMMIT PREPARED or ROLLBACK PREPARED it (pg_prepared_xacts)",
				Age(h.OldestPrepared.Seconds(), 1))
		}
		return fmt.Sprintf("%d prepared transactions, the oldest prepared %s ago, hold back the xmin horizon: COMMIT PREPARED or ROLLBACK PREPARED them (pg_prepared_xacts)",
			h.Prepared, Age(h.OldestPrepared.Seconds(), 1))
	}
	return ""
}
