-- Reverts 013: migration 009's txoutbox_prepare (no upper bound on check_immunity);
-- txoutbox_check_immunity dropped; the contract's version is 12 again.
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
    IF check_immunity < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = format('txoutbox_prepare: check_immunity: invalid argument: must not be negative (0 or NULL: checked from the check-back''s transaction timeout on), got %s', check_immunity);
    END IF;
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

DROP FUNCTION txoutbox_check_immunity(text, interval);

CREATE OR REPLACE FUNCTION txoutbox_contract_version() RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$ SELECT 12 $fn$;
