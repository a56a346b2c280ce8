package relay

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/txoutbox/txoutbox/internal/store"
)

// The claim floor keeps the claim from walking the dead index entries of the rows it already
// settled: claims start above the floor (store.ClaimArgs.After). Normally VACUUM and the
// index's own hints clear those entries; while a transaction holds the xmin horizon back
// (a long report, an idle-in-transaction session) neither can, and a claim from the start of
// the index gets slower with every row settled since. See internal/store/floor.go for when a
// floor is safe; this file keeps it.
const (
	// floorCheckInterval is how often the relay reads the writers and the lowest ready and
	// dead ids to move the floor (one small statement after a claim).
	floorCheckInterval = 250 * time.Millisecond
	// floorRescanInterval is how often the relay looks below the floor for a ready row
	// anyway, in the background on a pool connection: a safety net (a row below the floor
	// would wait at most this long) that walks every dead entry below the floor while the
	// horizon is held back, so it stays off the claim path.
	floorRescanInterval = time.Minute
)

// claimFloor is the relay's floor state. It belongs to the claim loop.
type claimFloor struct {
	mu sync.Mutex
	// after is the floor: claims skip ids at or below it.
	after int64
	// parts and gen are the partitions and lease generation the floor was built under; any
	// change resets it.
	parts []int32
	gen   uint64
	// final: every id at or below it is final (no transaction that drew one is open).
	final int64
	// A pending checkpoint: every id at or below cpMax is final once none of cpWriters is
	// open (and no prepared transaction holds a write lock). cpWriters nil: none pending.
	cpMax     int64
	cpWriters []string
	// seen is the highest id claimed under this floor.
	seen int64

	lastCheck, lastProbe time.Time
	probing              bool
	// checkEvery and rescanEvery are floorCheckInterval and floorRescanInterval; tests change
	// them.
	checkEvery, rescanEvery time.Duration
}

func newClaimFloor() *claimFloor {
	return &claimFloor{checkEvery: floorCheckInterval, rescanEvery: floorRescanInterval}
}

// bound returns the floor for a claim of parts under gen. A change of partitions resets it
// to 0 (a claim from the start).
func (f *claimFloor) bound(parts []int32, gen uint64) int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	if gen != f.gen || !slices.Equal(parts, f.parts) {
		f.after, f.final, f.cpMax, f.cpWriters, f.seen = 0, 0, 0, nil, 0
		f.parts, f.gen = slices.Clone(parts), gen
		f.lastCheck, f.lastProbe = time.Time{}, time.Now()
	}
	return f.after
}

// claimed records the ids a claim returned.
func (f *claimFloor) claimed(rows []store.Claimed) {
	if len(rows) == 0 {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seen = max(f.seen, rows[len(rows)-1].ID) // claims return rows in id order
}

// due reports whether a check is due, and counts it as done.
func (f *claimFloor) due(now time.Time) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if now.Sub(f.lastCheck) < f.checkEvery {
		return false
	}
	f.lastCheck = now
	return true
}

// args is what the check reads, and the partitions and generation it reads them for.
func (f *claimFloor) args(count int32) (store.FloorArgs, []int32, uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	a := store.FloorArgs{After: f.after, PartitionCount: count}
	if len(f.parts) < int(count) {
		a.Partitions = f.parts
	}
	return a, f.parts, f.gen
}

// update moves the floor with a reading taken for parts under gen.
func (f *claimFloor) update(parts []int32, gen uint64, st store.ClaimFloorState) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if gen != f.gen || !slices.Equal(parts, f.parts) {
		return // the partitions changed meanwhile: the reading is of another floor
	}
	// The floor may rise to what was final before this reading's statement started (the
	// checkpoint passed in an earlier statement), below every ready and dead row it saw.
	nf := f.final
	if st.MinReady > 0 {
		nf = min(nf, st.MinReady-1)
	}
	if st.MinDead > 0 {
		nf = min(nf, st.MinDead-1)
	}
	f.after = max(f.after, nf)
	if st.MinDead > 0 && st.MinDead <= f.after {
		f.after = st.MinDead - 1 // cannot happen (see store/floor.go); never stand above a dead row
	}
	// The pending checkpoint passes once its writers have all ended.
	if f.cpWriters != nil && !st.Prepared && !slices.ContainsFunc(st.Writers, func(w string) bool { return slices.Contains(f.cpWriters, w) }) {
		f.final = max(f.final, f.cpMax)
		f.cpWriters = nil
	}
	// A new checkpoint: every id claimed so far was drawn before this reading.
	if f.cpWriters == nil && f.seen > f.final {
		f.cpMax = f.seen
		f.cpWriters = append([]string{}, st.Writers...)
	}
}

// probeDue reports whether a look below the floor is due (and none is running), and marks
// one as running; it returns the floor's partitions, generation and value to probe.
func (f *claimFloor) probeDue(now time.Time) (parts []int32, gen uint64, after int64, ok bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.probing || f.after == 0 || now.Sub(f.lastProbe) < f.rescanEvery {
		return nil, 0, 0, false
	}
	f.probing, f.lastProbe = true, now
	return f.parts, f.gen, f.after, true
}

// probed lowers the floor below a ready row a probe found at or below it (0: none).
func (f *claimFloor) probed(parts []int32, gen uint64, found int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.probing = false
	if found == 0 || gen != f.gen || !slices.Equal(parts, f.parts) {
		return
	}
	f.after = min(f.after, found-1)
	f.final = min(f.final, found-1)
	f.cpWriters = nil
	f.cpMax = 0
}

// Floor returns the claim floor (for tests and diagnostics).
func (f *claimFloor) Floor() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.after
}

// checkFloor reads the floor's state on the relay's lease connection and moves the floor. It
// runs where it delays no publish: after a settle, or after a claim that found nothing. A
// failure leaves the floor where it is.
func (r *Relay) checkFloor(ctx context.Context, conn store.DBTX) {
	if !r.floor.due(time.Now()) {
		return
	}
	a, parts, gen := r.floor.args(int32(r.cfg.Partitions))
	if parts == nil {
		return // no claim yet
	}
	st, err := r.q.ClaimFloor(ctx, conn, a)
	if err != nil {
		return
	}
	r.floor.update(parts, gen, st)
}

// probeFloor looks for a ready row at or below the floor, on a pool connection, and lowers
// the floor below it if there is one (there should not be: see store/floor.go).
func (r *Relay) probeFloor(ctx context.Context, parts []int32, gen uint64, after int64) {
	a := store.FloorArgs{After: after, PartitionCount: int32(r.cfg.Partitions)}
	if len(parts) < r.cfg.Partitions {
		a.Partitions = parts
	}
	found, err := r.q.ReadyAtOrBelow(ctx, r.pool, a)
	if err != nil {
		found = 0
	}
	if found > 0 {
		r.log.Warn("a ready row was found below the claim floor; claiming from below it", "id", found, "floor", after)
	}
	r.floor.probed(parts, gen, found)
}
