package migrations

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox"
)

// Roles of least privilege, for Grants.
const (
	// RoleProducer inserts messages (EnqueueTx, Prepare), settles its half messages (Commit,
	// CommitTx, Rollback) and cancels or moves its delayed messages (CancelTx, RescheduleTx and
	// their business key forms, which find rows by header: so it can read every message's
	// headers and delivery time, since migration 5). It cannot delete outbox rows, read their
	// payloads, change a payload, headers or subject, or touch consumers' dedup rows; it inserts
	// only the columns a producer writes, and row-level security holds its rows to what the
	// clients write: never failed or due later (which would hold back the message's key), in
	// the partition of the message's key.
	RoleProducer = "producer"
	// RoleRelay claims, publishes and settles rows, keeps its membership row and partition
	// leases, and runs the check-back (resolve, stale report, purge of published, rolled back
	// and dedup rows). It cannot insert messages, nor change what one says (it updates the
	// columns of the relay's and the check-back's writes only: never the payload, subject,
	// headers, key, partition key or id).
	RoleRelay = "relay"
	// RoleConsumer records the messages it processed in the dedup table and, in ordered mode,
	// each key's applied sequence. It cannot touch the outbox.
	RoleConsumer = "consumer"
	// RoleAdmin owns the schema and txoutbox's objects in it (the txoutbox_* tables, functions,
	// sequences, views and types, version tables included), not the application's objects nor
	// any extension's: it migrates (relay migrate up/down), runs every admin command and grants
	// the other roles.
	RoleAdmin = "admin"
)

// Roles lists the roles Grants knows, in the order of the README.
var Roles = []string{RoleProducer, RoleRelay, RoleConsumer, RoleAdmin}

// ErrUnknownRole: Grants was asked for a role it does not know (not one of Roles). Grants
// returns it as the Err of a *txoutbox.ConfigError naming the argument role.
var ErrUnknownRole = errors.New("migrations: unknown role: want producer, relay, consumer or admin")

// GrantOptions tune Grants.
type GrantOptions struct {
	// SignalBackend also grants pg_signal_backend to the relay role. A relay fences a relay
	// that stopped heartbeating but still holds partition leases by terminating its lease
	// session (pg_terminate_backend), which PostgreSQL allows on sessions of the same role
	// (or of a role the caller is a member of) without it: grant it only when relays log in
	// as different roles. Defaults to false.
	SignalBackend bool
	// Consumers, for RoleConsumer, are the consumer (durable) names whose rows of the dedup
	// and key-order tables the grantee may read and write: row-level security hides the other
	// consumers' rows from it and refuses writing them. Empty (the default): every consumer's
	// rows, as consumers sharing a schema trust each other.
	Consumers []string
}

// adminOwnership gives txoutbox's own objects of a schema (%[1]s, a literal) to a role (%[2]s,
// a literal): the relations, routines and types named txoutbox_*, and the version tables the
// migrations runner keeps or reads as txoutbox's own (%[3]s, a name[] expression); never a
// member of an extension, nor any other object of the schema (the application's tables and
// functions, an extension's functions in public, golang-migrate's or goose's default version
// table, which may be the application's: relay migrate leaves a schema those tools manage to
// them). Relations by their kind (tables carry their indexes, identity
// sequences and row types; sequences owned by a column go with their table), routines, and
// the types that are not a relation's row type, an array or a range's multirange.
const adminOwnership = `DO $txoutbox$DECLARE r record;
BEGIN
  FOR r IN SELECT format('ALTER %%s %%I.%%I OWNER TO %%I', CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                  WHEN 'S' THEN 'SEQUENCE' WHEN 'f' THEN 'FOREIGN TABLE' ELSE 'TABLE' END, n.nspname, c.relname, %[2]s) AS stmt
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE n.nspname = %[1]s AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
             AND (c.relname LIKE 'txoutbox\_%%' OR c.relname = ANY (%[3]s))
             AND NOT (c.relkind = 'S' AND EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
                      AND d.objid = c.oid AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')))
             AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.deptype = 'e')
         UNION ALL
         SELECT format('ALTER %%s %%s OWNER TO %%I', CASE p.prokind WHEN 'p' THEN 'PROCEDURE' WHEN 'a' THEN 'AGGREGATE' ELSE 'FUNCTION' END,
                  p.oid::regprocedure, %[2]s)
           FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
           WHERE n.nspname = %[1]s AND p.proname LIKE 'txoutbox\_%%'
             AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e')
         UNION ALL
         SELECT format('ALTER %%s %%I.%%I OWNER TO %%I', CASE t.typtype WHEN 'd' THEN 'DOMAIN' ELSE 'TYPE' END, n.nspname, t.typname, %[2]s)
           FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
           WHERE n.nspname = %[1]s AND t.typtype IN ('c', 'd', 'e', 'r') AND t.typelem = 0 AND t.typname LIKE 'txoutbox\_%%'
             AND (t.typrelid = 0 OR (SELECT c.relkind FROM pg_class c WHERE c.oid = t.typrelid) = 'c')
             AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_type'::regclass AND d.objid = t.oid AND d.deptype = 'e')
  LOOP
    EXECUTE r.stmt;
  END LOOP;
END$txoutbox$;
`

// ProducerRowsRole is the NOLOGIN role (one per cluster) the producer grants make every
// producer grantee a member of: on txoutbox_messages, row-level security gives its members the
// rows a producer settles, cancels or moves, and every other role every row.
const ProducerRowsRole = "txoutbox_restricted_producers"

// producerRowsComment introduces producerRows in the SQL Grants writes.
const producerRowsComment = `-- Row-level security: a producer updates only the rows a producer settles or moves (half
-- messages, delayed messages, and ready rows whose current version its own transaction wrote):
-- not another service's ready, published, dead or rolled back messages. It inserts and leaves
-- rows as a producer writes them: never failed (attempts 0) nor due later (next_attempt_at), which
-- would hold back every later message of the key, and in the partition of their key (or id).
-- Other roles see every row.
`

// OwnRowVersionFunc is the function (in the outbox schema, created by the producer grants, not
// by a migration) that the producer's row-level security calls with a row version's xmin: true
// when the current transaction, or one of its subtransactions, wrote that version. The grants
// give it to the owner of txoutbox_messages; migration 001's down drops it.
const OwnRowVersionFunc = "txoutbox_row_version_is_mine"

// ownRowVersion creates OwnRowVersionFunc in schema %[1]s (a sanitized identifier). A row
// version that the caller's snapshot sees and whose xmin is a transaction still in progress
// was written by the caller's own transaction (or one of its subtransactions: a savepoint):
// MVCC shows no one another transaction's uncommitted versions. The xmin is a 32-bit xid and
// pg_xact_status takes a 64-bit xid8 (PostgreSQL 15 has no xid to xid8 cast), so the xid8 is
// rebuilt from the current transaction's: the caller's own xids are its top-level xid or
// later, so an xmin that is behind it (modulo 2^32) is someone else's, and one ahead of it
// is placed in the top-level xid's epoch. pg_xact_status raises an error for an xid in the
// future, which a frozen version's xmin (kept as written, possibly 2^31 or more transactions
// old) may appear to be: caught, it is not the caller's. The function runs with the caller's
// privileges and a fixed search_path (pg_catalog), so a caller's objects cannot stand in for
// the built-in functions and operators.
const ownRowVersion = `CREATE OR REPLACE FUNCTION %[1]s.` + OwnRowVersionFunc + `(row_xmin xid) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY INVOKER SET search_path = pg_catalog, pg_temp AS $txoutbox$
DECLARE
    top bigint := pg_current_xact_id()::text::bigint;
    ahead bigint := ((row_xmin::text::bigint - (top & 4294967295)) %% 4294967296 + 4294967296) %% 4294967296;
BEGIN
    IF ahead = 0 THEN
        RETURN true; -- the top-level transaction's own xid
    ELSIF ahead >= 2147483648 THEN
        RETURN false; -- before the current transaction's first xid: another transaction's
    ELSIF top + ahead < pg_snapshot_xmax(pg_current_snapshot())::text::bigint THEN
        RETURN coalesce(pg_xact_status((top + ahead)::text::xid8) = 'in progress', false);
    END IF;
    BEGIN -- a subtransaction's xid since the snapshot, or a frozen version's xmin
        RETURN coalesce(pg_xact_status((top + ahead)::text::xid8) = 'in progress', false);
    EXCEPTION WHEN invalid_parameter_value THEN
        RETURN false; -- "in the future": a frozen version's xmin, not the caller's
    END;
END
$txoutbox$;
`

// retiredFunctions are the functions the producer grants leave out (a SQL list of names):
// migration 004's, kept by migration 005 under these names, called by nothing since 007.
const retiredFunctions = "'txoutbox_enqueue_v4', 'txoutbox_enqueue_many_v4', 'txoutbox_prepare_v4'"

// PartitionKeyFunc is the function (in the outbox schema, created by the producer grants, not
// by a migration) that the producer's row-level security calls to test a new row's
// partition_key: the partition key of a message of key msg_key (NULL for none) and id
// message_id, as the Go client (outbox.Client) and the SQL functions (txoutbox_key_hash,
// txoutbox_partition_keys) compute it. The grants give it to the owner of txoutbox_messages;
// migration 001's down drops it.
const PartitionKeyFunc = "txoutbox_producer_partition_key"

// partitionKey creates PartitionKeyFunc in schema %[1]s (a sanitized identifier): FNV-1a
// (32 bits) of the UTF-8 bytes of the key, or of the id's text without a key, masked to 31
// bits. Eight bytes a statement, then one at a time, as migration 10's txoutbox_fnv (which a
// schema below migration 10 does not have: the grants do not depend on the migration version).
// It runs with the caller's privileges and a fixed search_path (pg_catalog), so a caller's
// operators cannot stand in for the built-in ones and make a forged partition_key pass.
const partitionKey = `CREATE OR REPLACE FUNCTION %[1]s.` + PartitionKeyFunc + `(msg_key text, message_id uuid) RETURNS int4
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE SECURITY INVOKER SET search_path = pg_catalog, pg_temp AS $txoutbox$
DECLARE
    b bytea := convert_to(coalesce(msg_key, message_id::text), 'UTF8');
    n int := length(b);
    h bigint := 2166136261;
    j int := 0;
BEGIN
    WHILE j + 8 <= n LOOP
        h := ((((((((((((((((h # get_byte(b, j)) * 16777619 & 4294967295)
                            # get_byte(b, j + 1)) * 16777619 & 4294967295)
                            # get_byte(b, j + 2)) * 16777619 & 4294967295)
                            # get_byte(b, j + 3)) * 16777619 & 4294967295)
                            # get_byte(b, j + 4)) * 16777619 & 4294967295)
                            # get_byte(b, j + 5)) * 16777619 & 4294967295)
                            # get_byte(b, j + 6)) * 16777619 & 4294967295)
                            # get_byte(b, j + 7)) * 16777619 & 4294967295);
        j := j + 8;
    END LOOP;
    WHILE j < n LOOP
        h := (h # get_byte(b, j)) * 16777619 & 4294967295;
        j := j + 1;
    END LOOP;
    RETURN (h & 2147483647)::int4;
END
$txoutbox$;
`

// grantFunctionsOwner gives the functions the producer grants create (OwnRowVersionFunc,
// %[2]s, and PartitionKeyFunc, %[3]s: literals of their signatures) to the owner of
// txoutbox_messages (%[1]s, a literal of its quoted name), whose policies call them: the role
// that migrates (the admin role, which the admin grants also give every txoutbox_* routine),
// so that it may replace them and migration 001's down drops them with the outbox. Before,
// they stayed the property of whoever ran the grants (a superuser): an admin login could not
// drop them, and they outlived the outbox.
const grantFunctionsOwner = `DO $txoutbox$DECLARE o name := (SELECT pg_get_userbyid(c.relowner) FROM pg_class c WHERE c.oid = %[1]s::regclass);
BEGIN
  EXECUTE format('ALTER FUNCTION %%s OWNER TO %%I', %[2]s::regprocedure, o);
  EXECUTE format('ALTER FUNCTION %%s OWNER TO %%I', %[3]s::regprocedure, o);
END$txoutbox$;
`

// producerRows is the row-level security of the producer role on txoutbox_messages (%[1]s),
// for the members of ProducerRowsRole (%[3]s, named by the literal %[2]s; restrictedRoleSQL
// creates it and makes the grantee a member). Members may read every row (their column
// grants say which columns), insert rows as a producer writes them (in the states a producer
// writes, never failed nor due later: attempts 0 and next_attempt_at its default, now(); in the
// partition of their key, PartitionKeyFunc, %[5]s: a row with attempts > 0 held back every later
// message of its key, and one in another partition broke its key's order), and update only the rows a producer settles or moves: half
// messages (prepared, check_exhausted), delayed ones (scheduled), and ready rows of their own
// transaction, in it or one of its savepoints (the version's xmin is the caller's, tested by
// OwnRowVersionFunc, %[4]s: the SQL functions of migrations 5 and 7 turn a message they just
// enqueued into a delayed one, txoutbox_commit turns a committed delayed half message
// scheduled); the result must be prepared, ready, scheduled or rolled_back, never failed
// (attempts 0) nor due later than its writer's transaction began (next_attempt_at at most
// created_at, the writer's now(), or the caller's now(): a commit sets it to now(); another
// service's half message given attempts or a retry time in the future held back its key). A time test
// (created_at or settled_at against now(), the start of the caller's transaction) let a
// transaction held open since before another service's commit roll that message back. Roles that are not members get every row (one permissive policy, whose
// membership test is evaluated once per statement); the owner and superusers bypass row-level
// security; relay grantees have a permissive policy of their own (for a login that is both).
const producerRows = `ALTER TABLE %[1]s ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS txoutbox_unrestricted ON %[1]s;
CREATE POLICY txoutbox_unrestricted ON %[1]s USING ((SELECT NOT pg_has_role(%[2]s, 'MEMBER')))
  WITH CHECK ((SELECT NOT pg_has_role(%[2]s, 'MEMBER')));
DROP POLICY IF EXISTS txoutbox_producer_select ON %[1]s;
CREATE POLICY txoutbox_producer_select ON %[1]s FOR SELECT TO %[3]s USING (true);
DROP POLICY IF EXISTS txoutbox_producer_insert ON %[1]s;
CREATE POLICY txoutbox_producer_insert ON %[1]s FOR INSERT TO %[3]s
  WITH CHECK (state IN ('ready', 'prepared', 'scheduled') AND attempts = 0 AND next_attempt_at <= now()
              AND partition_key = %[5]s(msg_key, message_id));
DROP POLICY IF EXISTS txoutbox_producer_update ON %[1]s;
CREATE POLICY txoutbox_producer_update ON %[1]s FOR UPDATE TO %[3]s
  USING (state IN ('prepared', 'check_exhausted', 'scheduled') OR (state = 'ready' AND %[4]s(xmin)))
  WITH CHECK (state IN ('prepared', 'ready', 'scheduled', 'rolled_back') AND attempts = 0
              AND (state <> 'ready' OR next_attempt_at <= greatest(now(), created_at)));
`

// ConsumerRowsRole is the NOLOGIN role (one per cluster) that consumer grantees restricted to
// some consumer names (GrantOptions.Consumers) are members of; roles that are not members see
// every row of the dedup and key-order tables.
const ConsumerRowsRole = "txoutbox_restricted_consumers"

// restrictedRoleSQL creates a NOLOGIN role of row-level security (ProducerRowsRole,
// ConsumerRowsRole: %[2]s, named by the literal %[1]s) if missing and grants it to the
// grantee %[3]s.
const restrictedRoleSQL = `DO $txoutbox$BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %[1]s) THEN
    CREATE ROLE %[2]s NOLOGIN;
  END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
  NULL; -- created meanwhile by another session
END$txoutbox$;
GRANT %[2]s TO %[3]s;
`

// consumerRows is the row-level security of a consumer table (%[1]s): non-members of
// ConsumerRowsRole (the literal %[2]s) keep every row; the grantee's own policy (policySQL)
// gives it the rows of its consumer names.
const consumerRows = `ALTER TABLE %[1]s ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS txoutbox_unrestricted ON %[1]s;
CREATE POLICY txoutbox_unrestricted ON %[1]s USING ((SELECT NOT pg_has_role(%[2]s, 'MEMBER')))
  WITH CHECK ((SELECT NOT pg_has_role(%[2]s, 'MEMBER')));
`

// policyName is the name of grantee's own policy of a kind (prefix, "txoutbox_relay_" or
// "txoutbox_consumer_"): the prefix, the start of the role name and a hash of the whole name,
// at most 63 bytes, so that PostgreSQL does not truncate it and two grantees never share it
// (before, prefix+grantee was cut at 63 bytes: two long role names with a common start named
// the same policy, and granting the second dropped the first's).
func policyName(prefix, grantee string) string {
	sum := sha256.Sum256([]byte(grantee))
	h := hex.EncodeToString(sum[:4])
	keep := maxIdentifier - len(prefix) - 1 - len(h)
	return prefix + grantee[:min(len(grantee), keep)] + "_" + h
}

// maxIdentifier is PostgreSQL's identifier length limit, in bytes (NAMEDATALEN - 1).
const maxIdentifier = 63

// policySQL replaces grantee's policy (named policyName(prefix, grantee)) on table with
// "CREATE POLICY <name> ON <table> <rest>" (rest is SQL text, written as it is), and drops
// the policy an earlier version named prefix+grantee (cut at 63 bytes) when it is grantee's
// alone, so that re-running a grant cleans up; one another grantee shares is left to its own
// re-run.
func policySQL(b *strings.Builder, prefix, table, grantee, rest string) {
	name := pgx.Identifier{policyName(prefix, grantee)}.Sanitize()
	old := prefix + grantee
	if len(old) > maxIdentifier {
		old = old[:maxIdentifier]
	}
	lit := func(v string) string { return "'" + strings.ReplaceAll(v, "'", "''") + "'" }
	fmt.Fprintf(b, "DO $txoutbox$BEGIN\n  IF EXISTS (SELECT 1 FROM pg_policy WHERE polrelid = %s::regclass AND polname = %s\n"+
		"             AND polroles = ARRAY[(SELECT oid FROM pg_roles WHERE rolname = %s)]) THEN\n"+
		"    EXECUTE format('DROP POLICY %%I ON %%s', %s, %s);\n  END IF;\nEND$txoutbox$;\n",
		lit(table), lit(old), lit(grantee), lit(old), lit(table))
	fmt.Fprintf(b, "DROP POLICY IF EXISTS %s ON %s;\n", name, table)
	fmt.Fprintf(b, "CREATE POLICY %s ON %s %s\n", name, table, rest) // rest is text, never a format
}

// producerInsertColumns are the columns of txoutbox_messages the producer inserts, but
// deliver_at (migration 5, granted on its own line): those the Go client (internal/store's
// insertMessages and insertPrepared) and the SQL functions (txoutbox_write) write.
var producerInsertColumns = []string{"message_id", "subject", "msg_key", "partition_key", "headers", "payload", "state",
	"ready_at", "producer_group", "check_mode", "next_check_at"}

// relayUpdateColumns are the columns of txoutbox_messages the relay role updates: those the
// relay (internal/store's settle statements, the promotion of delayed messages: SET id =
// DEFAULT draws from the identity, which needs no sequence privilege) and the check-back
// (claimChecks, recordCheck, release, fence, and the commit and rollback of half messages)
// write; the admin commands (dead requeue, prepared resume, scheduled cancel) write no others.
// SELECT ... FOR UPDATE, which the check-back's purge and lease take, needs UPDATE on one
// column. Never message_id, subject, msg_key, partition_key, headers, payload, producer_group,
// check_mode, created_at or deliver_at.
var relayUpdateColumns = []string{"id", "state", "ready_at", "next_attempt_at", "attempts", "last_error",
	"published_at", "stream", "stream_seq", "next_check_at", "settled_by", "settled_at", "check_count"}

// narrowUpdate takes UPDATE on every column of a table (%[1]s, a literal of the quoted
// name) back from a grantee (%[2]s, a literal) that holds it, keeping the UPDATE of the columns
// granted to it one by one (another role's grants to the same grantee: the producer's); a
// table-level REVOKE takes the column grants of the privilege too.
const narrowUpdate = `DO $txoutbox$DECLARE keep text;
BEGIN
  IF EXISTS (SELECT 1 FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
             WHERE c.oid = %[1]s::regclass AND a.privilege_type = 'UPDATE'
               AND a.grantee = (SELECT oid FROM pg_roles WHERE rolname = %[2]s)) THEN
    SELECT string_agg(DISTINCT quote_ident(t.attname), ', ') INTO keep
      FROM pg_attribute t CROSS JOIN LATERAL aclexplode(t.attacl) a
     WHERE t.attrelid = %[1]s::regclass AND t.attnum > 0 AND NOT t.attisdropped AND a.privilege_type = 'UPDATE'
       AND a.grantee = (SELECT oid FROM pg_roles WHERE rolname = %[2]s);
    EXECUTE format('REVOKE UPDATE ON %%s FROM %%I', %[1]s, %[2]s);
    IF keep IS NOT NULL THEN
      EXECUTE format('GRANT UPDATE (%%s) ON %%s TO %%I', keep, %[1]s, %[2]s);
    END IF;
  END IF;
END$txoutbox$;
`

var roleNameRe = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// Grants returns SQL that gives grantee (created NOLOGIN if it does not exist; grant it to
// login roles, or name a login role) what role needs on the outbox in schema, and nothing
// more. The SQL does not depend on the migration version beyond the tables it names (those
// of every version so far); run it as the schema's owner or a superuser after the
// migrations, and again after a migration that adds tables.
//
// A bad argument is a *txoutbox.ConfigError naming it (Field "role", "schema" or "grantee";
// errors.Is(err, txoutbox.ErrInvalidConfig) holds), and no SQL: a role not in Roles (its Err
// is ErrUnknownRole), a schema ValidateSchemaName refuses or holding a '$', a grantee that is
// not 1 to 63 letters, digits and '_' not starting with a digit.
func Grants(role, schema, grantee string, opts *GrantOptions) (string, error) {
	bad := func(field, reason string, err error) error {
		return &txoutbox.ConfigError{Package: "migrations", Field: field, Reason: reason, Err: err}
	}
	if err := ValidateSchemaName(schema); err != nil {
		return "", bad("schema", err.Error(), nil)
	}
	if strings.Contains(schema, "$") {
		// The SQL's DO blocks are dollar-quoted ($txoutbox$) and hold the schema's name.
		return "", bad("schema", fmt.Sprintf("%q holds a '$', which Grants does not take", schema), nil)
	}
	if !roleNameRe.MatchString(grantee) {
		return "", bad("grantee", fmt.Sprintf("%q is not a role name of letters, digits and '_' (63 at most, not starting with a digit)", grantee), nil)
	}
	if !slices.Contains(Roles, role) {
		return "", bad("role", fmt.Sprintf("%q is unknown: want %s", role, strings.Join(Roles, ", ")), ErrUnknownRole)
	}
	var o GrantOptions
	if opts != nil {
		o = *opts
	}
	s := pgx.Identifier{schema}.Sanitize()
	g := pgx.Identifier{grantee}.Sanitize()
	t := func(table string) string { return pgx.Identifier{schema, table}.Sanitize() }
	lit := func(v string) string { return "'" + strings.ReplaceAll(v, "'", "''") + "'" }
	var b strings.Builder
	fmt.Fprintf(&b, "-- txoutbox: least privilege of the %s role on schema %s, granted to %s.\n", role, s, g)
	fmt.Fprintf(&b, "-- Generated by `relay migrate grants --role %s`; run it as the schema's owner or a superuser.\n", role)
	b.WriteString("BEGIN;\n")
	fmt.Fprintf(&b, "DO $txoutbox$BEGIN\n  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %s) THEN\n    CREATE ROLE %s NOLOGIN;\n  END IF;\nEND$txoutbox$;\n", lit(grantee), g)
	messages, relays, dedup := t("txoutbox_messages"), t("txoutbox_relays"), t("txoutbox_consumer_dedup")
	switch role {
	case RoleProducer:
		fmt.Fprintf(&b, "GRANT USAGE ON SCHEMA %s TO %s;\n", s, g)
		b.WriteString("-- EnqueueTx, Prepare and the SQL functions insert rows: the columns they write, no others (the\n")
		b.WriteString("-- id is drawn from the table's identity; attempts, next_attempt_at and created_at take their\n")
		b.WriteString("-- defaults). INSERT on every column, which earlier versions granted, is taken back first.\n")
		fmt.Fprintf(&b, "REVOKE INSERT ON %s FROM %s;\n", messages, g)
		fmt.Fprintf(&b, "GRANT INSERT (%s) ON %s TO %s;\n", strings.Join(producerInsertColumns, ", "), messages, g)
		b.WriteString("-- Commit, CommitTx and Rollback find their message, take its key's lock and settle it:\n")
		b.WriteString("-- the columns they read and write, not payloads or headers (a commit resets attempts and\n")
		b.WriteString("-- next_attempt_at, as migration 4's txoutbox_settle_half does: the row-level security below\n")
		b.WriteString("-- allows attempts 0 and no retry time in the future only).\n")
		fmt.Fprintf(&b, "GRANT SELECT (id, message_id, msg_key, partition_key, state, check_count) ON %s TO %s;\n", messages, g)
		fmt.Fprintf(&b, "GRANT UPDATE (id, state, ready_at, next_attempt_at, attempts, next_check_at, settled_by, settled_at, check_count) ON %s TO %s;\n", messages, g)
		b.WriteString("-- Delayed messages (migration 5) are inserted with their delivery time; CancelTx and\n")
		b.WriteString("-- RescheduleTx withdraw a scheduled row (state rolled_back) or move its delivery time; their\n")
		b.WriteString("-- business key forms find rows by the Txoutbox-Biz-Key header.\n")
		fmt.Fprintf(&b, "GRANT SELECT (deliver_at, headers), INSERT (deliver_at), UPDATE (deliver_at) ON %s TO %s;\n", messages, g)
		b.WriteString("-- The row-level security below calls these functions (created here, not by a migration).\n")
		fmt.Fprintf(&b, ownRowVersion, s)
		fmt.Fprintf(&b, partitionKey, s)
		b.WriteString("-- Owned by the owner of txoutbox_messages (the admin role, once granted), as txoutbox's other\n")
		b.WriteString("-- objects, not by the role that runs this SQL: its owner replaces them, and drops them when\n")
		b.WriteString("-- it takes the outbox down (migration 001's down).\n")
		fmt.Fprintf(&b, grantFunctionsOwner, lit(messages), lit(t(OwnRowVersionFunc)+"(xid)"), lit(t(PartitionKeyFunc)+"(text, uuid)"))
		b.WriteString("-- The SQL contract (migration 4): EXECUTE on the txoutbox_* functions (txoutbox_enqueue,\n")
		b.WriteString("-- txoutbox_enqueue_many, txoutbox_prepare, txoutbox_commit, txoutbox_commit_in_tx, txoutbox_rollback,\n")
		b.WriteString("-- since migration 5 txoutbox_cancel, txoutbox_reschedule and their business key forms, and the\n")
		b.WriteString("-- helpers they call, and the functions above), when the schema has them. They run with the\n")
		b.WriteString("-- caller's privileges. From migration 012 on, not migration 004's functions that migration\n")
		b.WriteString("-- 005 kept as *_v4 and nothing calls any more (012 takes EXECUTE on them back; below 012,\n")
		b.WriteString("-- the public functions of migrations 005 and 006 call them).\n")
		fmt.Fprintf(&b, "DO $txoutbox$DECLARE f regprocedure;\nBEGIN\n  FOR f IN SELECT p.oid::regprocedure FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace\n           WHERE n.nspname = %s AND p.proname LIKE 'txoutbox\\_%%'\n             AND (p.proname NOT IN (%s) OR to_regprocedure(quote_ident(%s) || '.txoutbox_contract_version()') IS NULL) LOOP\n    EXECUTE format('GRANT EXECUTE ON FUNCTION %%s TO %%I', f, %s);\n  END LOOP;\nEND$txoutbox$;\n",
			lit(schema), retiredFunctions, lit(schema), lit(grantee))
		b.WriteString(producerRowsComment)
		fmt.Fprintf(&b, restrictedRoleSQL, lit(ProducerRowsRole), pgx.Identifier{ProducerRowsRole}.Sanitize(), g)
		fmt.Fprintf(&b, producerRows, messages, lit(ProducerRowsRole), pgx.Identifier{ProducerRowsRole}.Sanitize(), t(OwnRowVersionFunc), t(PartitionKeyFunc))
	case RoleRelay:
		fmt.Fprintf(&b, "GRANT USAGE ON SCHEMA %s TO %s;\n", s, g)
		b.WriteString("-- Claim, publish, settle (delete or mark published, retry, dead), purge; the check-back settles half messages.\n")
		fmt.Fprintf(&b, "GRANT SELECT, DELETE ON %s TO %s;\n", messages, g)
		b.WriteString("-- UPDATE of the columns the relay and the check-back write (settle, retry, dead, promotion of\n")
		b.WriteString("-- delayed messages, which draws a new id, and the check-back's lease, checks and settles), not\n")
		b.WriteString("-- the message itself (message_id, subject, msg_key, partition_key, headers, payload): a leaked\n")
		b.WriteString("-- relay credential cannot change what the relay publishes. UPDATE on every column, which earlier\n")
		b.WriteString("-- versions granted, is taken back first (the grantee's column grants are kept).\n")
		fmt.Fprintf(&b, narrowUpdate, lit(messages), lit(grantee))
		fmt.Fprintf(&b, "GRANT UPDATE (%s) ON %s TO %s;\n", strings.Join(relayUpdateColumns, ", "), messages, g)
		b.WriteString("-- Every row, even for a login that is a producer too (see the producer's row-level security).\n")
		policySQL(&b, "txoutbox_relay_", messages, grantee, "TO "+g+" USING (true) WITH CHECK (true);")
		b.WriteString("-- Membership rows of the partition leases.\n")
		fmt.Fprintf(&b, "GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO %s;\n", relays, g)
		b.WriteString("-- The check-back purges old dedup rows (SELECT ... FOR UPDATE SKIP LOCKED needs UPDATE on a column).\n")
		fmt.Fprintf(&b, "GRANT SELECT, DELETE, UPDATE (processed_at) ON %s TO %s;\n", dedup, g)
		policySQL(&b, "txoutbox_relay_", dedup, grantee, "TO "+g+" USING (true) WITH CHECK (true);")
		b.WriteString("-- relay run checks the schema version at start (txoutbox's, golang-migrate's or goose's table,\n")
		b.WriteString("-- txoutbox's own tables of those tools included).\n")
		fmt.Fprintf(&b, "DO $txoutbox$DECLARE t text;\nBEGIN\n  FOREACH t IN ARRAY ARRAY[%s, %s, %s, %s, %s] LOOP\n    IF to_regclass(format('%%I.%%I', %s, t)) IS NOT NULL THEN\n      EXECUTE format('GRANT SELECT ON %%I.%%I TO %%I', %s, t, %s);\n    END IF;\n  END LOOP;\nEND$txoutbox$;\n",
			lit(VersionTable), lit(OwnGolangMigrateTable), lit(OwnGooseTable), lit(GolangMigrateTable), lit(GooseTable), lit(schema), lit(schema), lit(grantee))
		if o.SignalBackend {
			b.WriteString("-- Fencing a stale relay that logs in as another role (pg_terminate_backend).\n")
			fmt.Fprintf(&b, "GRANT pg_signal_backend TO %s;\n", g)
		}
	case RoleConsumer:
		fmt.Fprintf(&b, "GRANT USAGE ON SCHEMA %s TO %s;\n", s, g)
		b.WriteString("-- Record processed messages (INSERT ... ON CONFLICT DO NOTHING RETURNING).\n")
		fmt.Fprintf(&b, "GRANT SELECT, INSERT ON %s TO %s;\n", dedup, g)
		b.WriteString("-- Ordered consumers lock and advance each key's applied sequence (INSERT ... ON CONFLICT DO UPDATE RETURNING).\n")
		fmt.Fprintf(&b, "GRANT SELECT, INSERT, UPDATE ON %s TO %s;\n", t("txoutbox_consumer_key_order"), g)
		if len(o.Consumers) > 0 {
			names := make([]string, len(o.Consumers))
			for i, n := range o.Consumers {
				names[i] = lit(n)
			}
			fmt.Fprintf(&b, "-- Row-level security: the rows of consumers %s only.\n", strings.Join(names, ", "))
			fmt.Fprintf(&b, restrictedRoleSQL, lit(ConsumerRowsRole), pgx.Identifier{ConsumerRowsRole}.Sanitize(), g)
			for _, table := range []string{dedup, t("txoutbox_consumer_key_order")} {
				arr := "ARRAY[" + strings.Join(names, ", ") + "]::text[]"
				fmt.Fprintf(&b, consumerRows, table, lit(ConsumerRowsRole))
				policySQL(&b, "txoutbox_consumer_", table, grantee,
					"TO "+g+" USING (consumer = ANY ("+arr+")) WITH CHECK (consumer = ANY ("+arr+"));")
			}
		}
	case RoleAdmin:
		b.WriteString("-- The admin owns the schema and txoutbox's objects in it (the txoutbox_* tables with their\n")
		b.WriteString("-- indexes and sequences, functions, views and types, txoutbox's version tables), not the\n")
		b.WriteString("-- application's objects nor an extension's: it migrates up and down (a migration replaces\n")
		b.WriteString("-- or drops functions, which only their owner may), and runs every admin command.\n")
		fmt.Fprintf(&b, "ALTER SCHEMA %s OWNER TO %s;\n", s, g)
		fmt.Fprintf(&b, adminOwnership, lit(schema), lit(grantee), "ARRAY["+lit(VersionTable)+", "+lit(OwnGolangMigrateTable)+", "+lit(OwnGooseTable)+"]::name[]")
	}
	b.WriteString("COMMIT;\n")
	return b.String(), nil
}
