package store

import (
	"context"
	"fmt"
)

// The claim floor.
//
// The claim reads the ready index in id order from its start. Every row the relay settles
// leaves a dead entry there until VACUUM removes it, and VACUUM cannot while any transaction
// older than the row's deletion is open (the xmin horizon): with a transaction held open for
// minutes, every claim walks past all the rows settled since, and gets slower by the second.
// A floor lets the claim start where the live rows start: ClaimArgs.After.
//
// A floor F is safe when no row with an id at or below F can be claimable, now or later:
//
//   - no ready row at or below F exists (ready rows pin the floor: rows in flight, rows in
//     retry backoff, rows held back behind a failed row of their key);
//   - no dead row at or below F exists (a requeue makes a dead row ready again with its id);
//   - no transaction that drew an id at or below F is still open: ids are drawn before
//     commit, so a lower id can commit after a higher one was claimed.
//
// The last is what ClaimFloorState.Writers is for. Every transaction that draws an id (an
// INSERT, or a half message's commit, SET id = DEFAULT) holds a RowExclusiveLock on the table
// from before it draws until it ends, and pg_locks shows it to any role. So take M, an id
// every claim has seen (drawn before now), then read the lock holders V: every id at or below
// M was drawn by a transaction that has ended or is in V. Once a later read finds none of V
// (and no prepared transaction, whose locks change hands at PREPARE), every id at or below M
// is final. The relay (relay/floor.go) keeps such checkpoints in memory, raises the floor to
// min(final M, lowest ready id - 1, lowest dead id - 1), read in a statement that starts after
// the checkpoint passed, and resets it when its partitions change.
const floorSQL = `SELECT
  coalesce(array_agg(l.virtualtransaction) FILTER (WHERE l.pid IS NOT NULL), '{}'),
  count(*) FILTER (WHERE l.pid IS NULL) > 0,
  coalesce((SELECT min(o.id) FROM %[1]s o
            WHERE o.state = 'ready' AND o.id > $1::int8
              AND ($2::int4[] IS NULL OR o.partition_key %% $3::int4 = ANY($2::int4[]))), 0),
  coalesce((SELECT min(o.id) FROM %[1]s o
            WHERE o.state = 'dead'
              AND ($2::int4[] IS NULL OR o.partition_key %% $3::int4 = ANY($2::int4[]))), 0)
FROM pg_locks l
WHERE l.locktype = 'relation' AND l.relation = $4::text::regclass
  AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
  AND l.mode IN ('RowExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')`

// FloorArgs selects the rows ClaimFloor looks at: the claim's partitions, above After.
type FloorArgs struct {
	After          int64
	Partitions     []int32 // nil: all
	PartitionCount int32
}

// ClaimFloorState is one reading for the claim floor.
type ClaimFloorState struct {
	// Writers are the virtual transaction ids of the sessions holding a write lock on the
	// outbox table now; Prepared says whether a prepared transaction holds one.
	Writers  []string
	Prepared bool
	// MinReady is the lowest ready id above After in the partitions (0: none); MinDead the
	// lowest dead id in them (0: none). check_exhausted rows do not count: they become ready
	// only through a commit, which draws a new id, so they never pin the floor.
	MinReady int64
	MinDead  int64
}

// ClaimFloor reads the table's writers and the lowest ready and dead ids, in one statement.
func (q *Queries) ClaimFloor(ctx context.Context, db DBTX, a FloorArgs) (ClaimFloorState, error) {
	count := a.PartitionCount
	if count <= 0 {
		count = 1
	}
	var s ClaimFloorState
	err := db.QueryRow(ctx, q.floor, a.After, a.Partitions, count, q.Messages).Scan(&s.Writers, &s.Prepared, &s.MinReady, &s.MinDead)
	return s, err
}

func floorStatement(messages string) string { return fmt.Sprintf(floorSQL, messages) }

// ReadyAtOrBelow returns the lowest ready id at or below a.After in the partitions (0: none):
// the relay's check that nothing sits below its claim floor.
func (q *Queries) ReadyAtOrBelow(ctx context.Context, db DBTX, a FloorArgs) (int64, error) {
	count := a.PartitionCount
	if count <= 0 {
		count = 1
	}
	var id int64
	err := db.QueryRow(ctx, `SELECT coalesce(min(o.id), 0) FROM `+q.Messages+` o
WHERE o.state = 'ready' AND o.id <= $1::int8
  AND ($2::int4[] IS NULL OR o.partition_key % $3::int4 = ANY($2::int4[]))`, a.After, a.Partitions, count).Scan(&id)
	return id, err
}
