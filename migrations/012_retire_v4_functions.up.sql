-- txoutbox 012: retires migration 004's leftover functions, and says the contract's version.
--
-- Migration 004's txoutbox_enqueue, txoutbox_enqueue_many and txoutbox_prepare,
-- which migration 005 kept under the names txoutbox_enqueue_v4, txoutbox_enqueue_many_v4 and
-- txoutbox_prepare_v4, are no longer called by any function (since migration 007 the public
-- functions do their own checks and writes) and lack the checks added since (a negative
-- check_immunity, the delivery time, the Nats-Msg-Id text, the traceparent rules): they are
-- not part of the SQL contract. EXECUTE on them is taken back from every role but their owner,
-- so that a producer cannot call them, by mistake or otherwise, and relay migrate grants
-- leaves them out. They are kept, not dropped: reverting migration 005 renames them back.
-- (txoutbox_settle_half_v4 stays granted: txoutbox_settle_half calls it with the caller's
-- privileges.)
DO $do$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT o.oid::regprocedure AS f, a.grantee
             FROM pg_proc o CROSS JOIN LATERAL aclexplode(o.proacl) a
             WHERE o.oid IN ('txoutbox_enqueue_v4(text, bytea, text, jsonb, text, uuid)'::regprocedure,
                             'txoutbox_enqueue_many_v4(text[], bytea[], text[], jsonb[], text[], uuid[])'::regprocedure,
                             'txoutbox_prepare_v4(text, bytea, text, jsonb, text, uuid, text, boolean, interval)'::regprocedure)
               AND a.privilege_type = 'EXECUTE' AND a.grantee <> o.proowner LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM %s', r.f,
                       CASE WHEN r.grantee = 0 THEN 'PUBLIC' ELSE r.grantee::regrole::text END);
    END LOOP;
END
$do$;
REVOKE EXECUTE ON FUNCTION txoutbox_enqueue_v4(text, bytea, text, jsonb, text, uuid),
    txoutbox_enqueue_many_v4(text[], bytea[], text[], jsonb[], text[], uuid[]),
    txoutbox_prepare_v4(text, bytea, text, jsonb, text, uuid, text, boolean, interval) FROM PUBLIC;

-- The version of the SQL contract this schema holds: the migration that last changed it. A
-- client in any language may check it (SELECT txoutbox_contract_version()) before relying on
-- what a version added; 12 is the first version to say it. EXECUTE stays with PUBLIC: it
-- reads nothing.
CREATE FUNCTION txoutbox_contract_version() RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$ SELECT 12 $fn$;
