package bench

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// sqlTimer is a pgx QueryTracer and BatchTracer that adds up the wall time of the relay's
// statements by kind, so that a drain can say where the relay's time goes (claim, settle, and
// the rest: publishing and awaiting PubAcks) without touching the relay. For Query the time
// runs until the rows are closed, so a claim includes reading its rows; a batch (the relay
// claims in one with the promotion of due scheduled rows, store.PromoteAndClaim) counts whole,
// from SendBatch to its Close, as the kind of its claim or settle statement, if it has one.
type sqlTimer struct {
	mu    sync.Mutex
	kinds map[string]*sqlStat
}

type sqlStat struct {
	n     int
	total time.Duration
	max   time.Duration
	all   []time.Duration
}

type sqlStartKey struct{}

type sqlStart struct {
	kind string
	at   time.Time
}

func newSQLTimer() *sqlTimer { return &sqlTimer{kinds: map[string]*sqlStat{}} }

// sqlKind classifies the relay's statements (see internal/store).
func sqlKind(sql string) string {
	s := strings.TrimSpace(sql)
	switch {
	case strings.HasPrefix(s, "SELECT o.id, o.message_id"):
		return "claim"
	case strings.HasPrefix(s, "WITH ok AS"), strings.HasPrefix(s, "WITH okv AS"):
		return "settle"
	}
	return "other"
}

func (t *sqlTimer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, sqlStartKey{}, sqlStart{kind: sqlKind(data.SQL), at: time.Now()})
}

func (t *sqlTimer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	st, ok := ctx.Value(sqlStartKey{}).(sqlStart)
	if !ok {
		return
	}
	t.add(st.kind, time.Since(st.at))
}

func (t *sqlTimer) add(kind string, d time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.kinds[kind]
	if s == nil {
		s = &sqlStat{}
		t.kinds[kind] = s
	}
	s.n++
	s.total += d
	s.max = max(s.max, d)
	s.all = append(s.all, d)
}

// sqlBatch is a batch being traced: the kind its statements make it.
type sqlBatch struct {
	at   time.Time
	kind string
}

type sqlBatchKey struct{}

func (t *sqlTimer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return context.WithValue(ctx, sqlBatchKey{}, &sqlBatch{at: time.Now(), kind: "other"})
}

func (t *sqlTimer) TraceBatchQuery(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	if b, ok := ctx.Value(sqlBatchKey{}).(*sqlBatch); ok {
		if k := sqlKind(data.SQL); k != "other" {
			b.kind = k
		}
	}
}

func (t *sqlTimer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	if b, ok := ctx.Value(sqlBatchKey{}).(*sqlBatch); ok {
		t.add(b.kind, time.Since(b.at))
	}
}

func (t *sqlTimer) get(kind string) sqlStat {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.kinds[kind]; s != nil {
		c := *s
		c.all = append([]time.Duration(nil), s.all...)
		return c
	}
	return sqlStat{}
}

func (s sqlStat) String() string {
	if s.n == 0 {
		return "none"
	}
	return fmt.Sprintf("%d × avg %s (first tenth %s, last tenth %s, max %s) = %s", s.n, avg(s.all).Round(time.Microsecond),
		avg(s.all[:max(1, len(s.all)/10)]).Round(time.Microsecond), avg(s.all[len(s.all)-max(1, len(s.all)/10):]).Round(time.Microsecond),
		s.max.Round(time.Microsecond), s.total.Round(time.Millisecond))
}

func avg(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	var t time.Duration
	for _, x := range d {
		t += x
	}
	return t / time.Duration(len(d))
}
