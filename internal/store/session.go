package store

import "context"

// relaySessionSQL sets up the relay's own session (its lease connection, which claims and
// settles):
//
//   - application_name: operators (and pg_stat_activity queries) can tell it apart.
//   - plan_cache_mode = force_generic_plan: the first custom plans of a prepared claim on a
//     table without statistics yet would be planned for the literal values; one generic plan
//     is kept instead.
//   - enable_seqscan and enable_bitmapscan off: every statement the relay runs on this session
//     against the outbox reads an index in its order (the ready index for the claim, an index
//     on id for the settle, the scheduled and dead indexes) and stops early; the few-row
//     membership table and the lock and activity views it also reads are scanned as before
//     (nothing else can read them, and with jit off a disabled scan's inflated estimate costs
//     nothing).
//     Without statistics (a fresh outbox, or a backlog inserted faster than autoanalyze
//     runs, or autovacuum off) the planner cannot know that, and with the claim floor's
//     range condition it chose a bitmap scan of the whole backlog and a sort: 27-41 ms for a
//     claim of 500 rows over 50,000 ready ones, against 0.5 ms for the index walk (relay
//     TestClaimPlanWithoutStatistics). With the planner's own estimates right, it picks the
//     same index scans; nothing else is given up.
//   - jit off: the relay's statements run in milliseconds, and compiling one costs 100-250 ms.
//     PostgreSQL compiles when a plan's estimated cost passes jit_above_cost, which an
//     unanalysed table, a view over pg_stat_activity or a disabled scan easily does: the
//     first lease round took 250 ms of JIT compilation, the relay's first message was stored
//     310 ms after Run instead of 15 ms (the yardstick's drain includes the start).
//   - synchronous_commit off: a settle lost in a PostgreSQL crash only makes its rows ready
//     again, and they are republished and deduplicated as after a relay crash; in exchange the
//     relay waits for no WAL flush, except when a claim promotes delayed messages: a lost
//     promotion would make a published row scheduled again, which a cancel could then
//     withdraw, so the promotion statements turn synchronous_commit on for their transaction.
//   - TCP keepalives and user timeout: when the relay's host dies or its network is cut,
//     PostgreSQL ends this session — and releases its partition locks — within seconds instead
//     of the system default of about two hours, so a standby takes over.
//
// They apply to this session only.
const relaySessionSQL = `SELECT set_config('application_name', $1, false),
	set_config('plan_cache_mode', 'force_generic_plan', false),
	set_config('enable_seqscan', 'off', false),
	set_config('enable_bitmapscan', 'off', false),
	set_config('jit', 'off', false),
	set_config('synchronous_commit', 'off', false),
	set_config('tcp_keepalives_idle', '5', false),
	set_config('tcp_keepalives_interval', '2', false),
	set_config('tcp_keepalives_count', '3', false),
	set_config('tcp_user_timeout', '10000', false)`

// SetupRelaySession sets up db (a connection of its own, never returned to a pool) as a
// relay's claiming and settling session named appName; see relaySessionSQL for each setting
// and why.
func SetupRelaySession(ctx context.Context, db DBTX, appName string) error {
	_, err := db.Exec(ctx, relaySessionSQL, appName)
	return err
}
