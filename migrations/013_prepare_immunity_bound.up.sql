-- txoutbox 013: txoutbox_prepare refuses a check_immunity above the largest Go time.Duration.
--
-- outbox.Prepare takes PrepareOptions.CheckImmunity as a time.Duration, at most
-- 2562047h47m16.854775807s (about 292 years). txoutbox_prepare took any interval: one of
-- thousands of years failed in its INSERT with 'timestamp out of range' (SQLSTATE 22008), an
-- error of no TX code that named neither the function nor the argument. It is now refused
-- first, with TX008 naming check_immunity, like a negative one. Every value Prepare can be
-- given is accepted as before. New: txoutbox_check_immunity, which both checks live in. The
-- SQL contract's version is 13.

-- Raises TX008 naming ctx's check_immunity when it is negative or above the largest Go
-- time.Duration (its microseconds: 2562047:47:16.854775). PostgreSQL compares intervals with
-- a month counted as 30 days and a day as 24 hours, so an interval given in years passes up to
-- about 296 of them (a year counted as 360 days): harmless, the INSERT's timestamp reaches
-- year 294276. STABLE, not IMMUTABLE: the error text depends on IntervalStyle.
CREATE FUNCTION txoutbox_check_immunity(ctx text, check_immunity interval) RETURNS void
LANGUAGE plpgsql STABLE AS $fn$
BEGIN
    IF check_immunity < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = format('%scheck_immunity: invalid argument: must not be negative (0 or NULL: checked from the check-back''s transaction timeout on), got %s', ctx, check_immunity);
    END IF;
    IF check_immunity > interval '2562047:47:16.854775' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = format('%scheck_immunity: invalid argument: at most 2562047:47:16.854775, the largest Go time.Duration (a month counted as 30 days), got %s', ctx, check_immunity);
    END IF;
END
$fn$;

CREATE OR REPLACE FUNCTION txoutbox_prepare(subject text, payload bytea, key text DEFAULT NULL, headers jsonb DEFAULT NULL,
    biz_key text DEFAULT NULL, id uuid DEFAULT NULL, producer_group text DEFAULT NULL, fence boolean DEFAULT false,
    check_immunity interval DEFAULT NULL, deliver_at timestamptz DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    g text := nullif(producer_group, '');
BEGIN
    PERFORM txoutbox_check_immunity('txoutbox_prepare: ', check_immunity);
    IF NOT coalesce(fence, false) OR g IS NOT NULL THEN
        IF g IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'TX007',
                MESSAGE = 'txoutbox_prepare: producer_group: invalid producer group: empty (a group is required unless fence is true)';
        ELSIF octet_length(g) > 128 THEN
            RAISE EXCEPTION USING ERRCODE = 'TX007',
                MESSAGE = format('txoutbox_prepare: producer_group: invalid producer group: %s bytes, the limit is 128', octet_length(g));
        ELSIF g !~ '^[A-Za-z0-9_-]+$' THEN
            RAISE EXCEPTION USING ERRCODE = 'TX007',
                MESSAGE = format('txoutbox_prepare: producer_group: invalid producer group: %s: use letters, digits, ''-'' and ''_''', to_jsonb(g));
        END IF;
    END IF;
    RETURN (txoutbox_write('txoutbox_prepare', false, ARRAY[subject], ARRAY[payload], ARRAY[key], ARRAY[headers],
                           ARRAY[biz_key], ARRAY[id], ARRAY[deliver_at], g,
                           CASE WHEN coalesce(fence, false) THEN 'fence' ELSE 'checker' END, check_immunity))[1];
END
$fn$;

-- EXECUTE on txoutbox_check_immunity, not to PUBLIC, goes to whoever may execute
-- txoutbox_prepare, which calls it with the caller's privileges: its grantees (the producer
-- roles granted before this migration) and its owner (when another role runs this one), so
-- that they keep preparing.
REVOKE EXECUTE ON FUNCTION txoutbox_check_immunity(text, interval) FROM PUBLIC;
DO $do$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT g.grantee FROM pg_proc o
             CROSS JOIN LATERAL (SELECT a.grantee FROM aclexplode(o.proacl) a WHERE a.privilege_type = 'EXECUTE'
                                 UNION ALL SELECT o.proowner) g
             WHERE o.oid = 'txoutbox_prepare(text, bytea, text, jsonb, text, uuid, text, boolean, interval, timestamptz)'::regprocedure
               AND g.grantee <> (SELECT f.proowner FROM pg_proc f WHERE f.oid = 'txoutbox_check_immunity(text, interval)'::regprocedure) LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION txoutbox_check_immunity(text, interval) TO %s',
                       CASE WHEN r.grantee = 0 THEN 'PUBLIC' ELSE r.grantee::regrole::text END);
    END LOOP;
END
$do$;

CREATE OR REPLACE FUNCTION txoutbox_contract_version() RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$ SELECT 13 $fn$;
