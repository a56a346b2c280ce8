DROP TABLE txoutbox_consumer_dedup;
DROP TABLE txoutbox_messages;

-- The functions `relay migrate grants --role producer` creates in the schema for the producer's
-- row-level security on txoutbox_messages (whose policies went with the table): not a
-- migration's, but txoutbox's, and of no use without the outbox. Dropped when the role running
-- this may (their owner, a member of it, or a superuser: the grants give them to the owner of
-- txoutbox_messages); else left, with a warning.
DO $do$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT p.oid::regprocedure AS f, pg_get_userbyid(p.proowner) AS owner, pg_has_role(p.proowner, 'USAGE') AS may
             FROM pg_proc p
             WHERE p.oid IN (to_regprocedure(format('%I.txoutbox_row_version_is_mine(xid)', current_schema())),
                             to_regprocedure(format('%I.txoutbox_producer_partition_key(text, uuid)', current_schema()))) LOOP
        IF r.may THEN
            EXECUTE format('DROP FUNCTION %s', r.f);
        ELSE
            RAISE WARNING 'txoutbox: function % is left: it is owned by %, not by the role taking the outbox down', r.f, r.owner;
        END IF;
    END LOOP;
END
$do$;
