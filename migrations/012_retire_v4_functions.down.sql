-- Reverts 012: txoutbox_contract_version dropped; EXECUTE on txoutbox_enqueue_v4, txoutbox_enqueue_many_v4 and
-- txoutbox_prepare_v4 goes back to the roles that may execute their successors
-- (txoutbox_enqueue, txoutbox_enqueue_many, txoutbox_prepare), as before 012 the producer
-- grants gave both.
DROP FUNCTION txoutbox_contract_version();

DO $do$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT old.f, a.grantee
             FROM (VALUES ('txoutbox_enqueue_v4(text, bytea, text, jsonb, text, uuid)'::regprocedure,
                           'txoutbox_enqueue(text, bytea, text, jsonb, text, uuid, timestamptz)'::regprocedure),
                          ('txoutbox_enqueue_many_v4(text[], bytea[], text[], jsonb[], text[], uuid[])'::regprocedure,
                           'txoutbox_enqueue_many(text[], bytea[], text[], jsonb[], text[], uuid[], timestamptz[])'::regprocedure),
                          ('txoutbox_prepare_v4(text, bytea, text, jsonb, text, uuid, text, boolean, interval)'::regprocedure,
                           'txoutbox_prepare(text, bytea, text, jsonb, text, uuid, text, boolean, interval, timestamptz)'::regprocedure)) AS old(f, successor)
             JOIN pg_proc s ON s.oid = old.successor
             JOIN pg_proc o ON o.oid = old.f
             CROSS JOIN LATERAL aclexplode(s.proacl) a
             WHERE a.privilege_type = 'EXECUTE' AND a.grantee <> o.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', r.f,
                       CASE WHEN r.grantee = 0 THEN 'PUBLIC' ELSE r.grantee::regrole::text END);
    END LOOP;
END
$do$;
