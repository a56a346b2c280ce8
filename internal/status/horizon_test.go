package status

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// A session holding a snapshot open shows up in the horizon, and (past the threshold) as a
// problem naming its age, pid and application_name, never its query.
func TestHorizonWarnsAboutAnOpenTransaction(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	q := store.New(db.Schema)

	cfg, err := pgx.ParseConfig(db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["application_name"] = "horizon-test-holder"
	holder, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close(ctx)
	tx, err := holder.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	// The snapshot is taken by the first statement; its text carries a "secret" that must
	// not reach the page.
	var pid int32
	if err := tx.QueryRow(ctx, "SELECT pg_backend_pid() /* secret-token-123 */").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	var started time.Time
	if err := tx.QueryRow(ctx, "SELECT now()").Scan(&started); err != nil {
		t.Fatal(err)
	}

	var open time.Duration
	if err := db.Pool.QueryRow(ctx, "SELECT extract(epoch FROM now() - $1::timestamptz)::float8 * interval '1 second'", started).Scan(&open); err != nil {
		t.Fatal(err)
	}
	h, err := q.XminHorizon(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	// Other tests share the database: the oldest may be theirs, but it is at least as old.
	if h.OldestXact < open || h.OldestPID == 0 {
		t.Fatalf("horizon %+v, want the oldest transaction at least %s old", h, open)
	}

	// With no threshold the panel warns; the warning names whichever transaction is oldest.
	tbl, err := horizonPanel(ctx, db.Pool, q, 0)
	if err != nil {
		t.Fatal(err)
	}
	if tbl == nil || tbl.Warning == "" || len(tbl.Rows) == 0 {
		t.Fatalf("panel %+v, want a warning", tbl)
	}
	if !strings.Contains(tbl.Warning, "pid ") || !strings.Contains(tbl.Warning, "application_name") {
		t.Errorf("warning %q does not name the pid and application_name", tbl.Warning)
	}
	for _, s := range append([]string{tbl.Warning, tbl.Note}, tbl.Rows[0]...) {
		if strings.Contains(s, "secret-token") {
			t.Errorf("the panel shows query text: %q", s)
		}
	}

	// The default threshold: a transaction a few milliseconds old is no problem.
	snap, err := Collect(ctx, db.Pool, q, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range snap.Problems {
		if strings.Contains(p, "pid "+strconv.Itoa(int(pid))+",") {
			t.Errorf("a fresh transaction is reported as a problem: %q", p)
		}
	}
}

// The warning line for each kind of holder, and none below the threshold.
func TestHorizonWarning(t *testing.T) {
	t.Parallel()
	h := store.Horizon{OldestXact: 3*time.Minute + 5*time.Second, OldestPID: 4242, OldestApp: "report", OldestState: "idle in transaction"}
	w := horizonWarning(h, time.Minute)
	for _, want := range []string{"3m05s", "pid 4242", `application_name "report"`, "idle in transaction"} {
		if !strings.Contains(w, want) {
			t.Errorf("warning %q lacks %q", w, want)
		}
	}
	if w := horizonWarning(h, 5*time.Minute); w != "" {
		t.Errorf("below the threshold: %q", w)
	}
	p := store.Horizon{Prepared: 2, OldestPrepared: 2 * time.Minute}
	if w := horizonWarning(p, time.Minute); !strings.Contains(w, "2 prepared transactions, the oldest prepared 2m00s ago, hold back") {
		t.Errorf("prepared: %q", w)
	}
	if w := horizonWarning(store.Horizon{}, 0); w != "" {
		t.Errorf("nothing open: %q", w)
	}
}
