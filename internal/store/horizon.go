package store

import (
	"context"
	"time"
)

// The xmin horizon: the oldest transaction snapshot PostgreSQL must keep row versions for.
// While a transaction stays open (idle in transaction, a long report, a forgotten psql
// session, a prepared transaction, a replication slot with hot_standby_feedback), VACUUM
// cannot remove the rows the relay deletes or marks published, and the claim's index scan
// walks past their dead entries. The relay samples it as metrics and the status page warns
// about it.
//
// Sessions of other roles show their transaction start and xmin only to superusers and
// members of pg_read_all_stats: without that the horizon reports what the role can see.
const horizonSQL = `WITH s AS (
  SELECT a.pid, coalesce(a.application_name, '') AS app, coalesce(a.state, '') AS state,
         extract(epoch FROM now() - a.xact_start)::float8 AS age_s,
         greatest(age(a.backend_xmin), age(a.backend_xid)) AS xid_age
  FROM pg_stat_activity a
  WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
    AND a.backend_type <> 'autovacuum worker'
    AND a.xact_start IS NOT NULL
    AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
), oldest AS (
  SELECT * FROM s ORDER BY age_s DESC LIMIT 1
), p AS (
  SELECT count(*) AS n, extract(epoch FROM now() - min(prepared))::float8 AS age_s, max(age(transaction)) AS xid_age
  FROM pg_prepared_xacts WHERE database = current_database()
), r AS (
  SELECT max(age(xmin)) AS xid_age FROM pg_replication_slots WHERE xmin IS NOT NULL
)
SELECT coalesce((SELECT age_s FROM oldest), 0), coalesce((SELECT pid FROM oldest), 0),
       coalesce((SELECT app FROM oldest), ''), coalesce((SELECT state FROM oldest), ''),
       coalesce((SELECT max(xid_age) FROM s), 0),
       p.n, coalesce(p.age_s, 0), coalesce(p.xid_age, 0),
       coalesce(r.xid_age, 0)
FROM p, r`

// Horizon is what holds back PostgreSQL's xmin horizon in the outbox's database.
type Horizon struct {
	// OldestXact is the age of the oldest open transaction that holds a snapshot or a
	// transaction id (0 when none); OldestPID, OldestApp (application_name) and OldestState
	// (pg_stat_activity.state, e.g. "idle in transaction") say whose it is. Never its query.
	OldestXact  time.Duration
	OldestPID   int32
	OldestApp   string
	OldestState string
	// XactXminAge is the age, in transaction ids, of the oldest xmin or xid among sessions.
	XactXminAge int64
	// Prepared counts two-phase transactions prepared in this database; OldestPrepared is the
	// age of the oldest and PreparedXminAge its age in transaction ids.
	Prepared        int64
	OldestPrepared  time.Duration
	PreparedXminAge int64
	// SlotXminAge is the age, in transaction ids, of the oldest xmin a replication slot holds
	// (a standby's hot_standby_feedback).
	SlotXminAge int64
}

// XminAge is the horizon's age in transaction ids: the oldest of sessions, prepared
// transactions and replication slots.
func (h Horizon) XminAge() int64 { return max(h.XactXminAge, h.PreparedXminAge, h.SlotXminAge) }

// XminHorizon reads what holds back the xmin horizon: three small catalog views, no table.
func (q *Queries) XminHorizon(ctx context.Context, db DBTX) (Horizon, error) {
	var h Horizon
	var age, prepAge float64
	err := db.QueryRow(ctx, horizonSQL).Scan(&age, &h.OldestPID, &h.OldestApp, &h.OldestState, &h.XactXminAge,
		&h.Prepared, &prepAge, &h.PreparedXminAge, &h.SlotXminAge)
	h.OldestXact, h.OldestPrepared = seconds(age), seconds(prepAge)
	return h, err
}
