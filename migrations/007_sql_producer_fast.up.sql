-- txoutbox 007: a faster SQL producer path (txoutbox_enqueue, txoutbox_enqueue_many,
-- txoutbox_prepare). The rules do not change: the same validation, errors, key hashes and
-- lock order as migrations 004 and 005. What changes is how much server CPU a message costs:
--   * headers of one ASCII header with nothing escaped ({"name": ["value"]}, the usual
--     traceparent) are read with string functions instead of two regular expressions;
--   * a subject's first token is compared with the reserved ones only when it starts with '$';
--   * UUIDv7 ids read the clock as double precision, not numeric;
--   * partition keys (FNV-1a) are hashed in one PL/pgSQL call per batch, after the checks,
--     instead of one call per message;
--   * txoutbox_enqueue and txoutbox_enqueue_many without delivery times call txoutbox_write
--     directly (one PL/pgSQL layer instead of two).
-- One rule is added, so that the SQL contract agrees with the Go client again:
-- txoutbox_prepare refuses a negative check_immunity (TX008), as Prepare does.

-- The partition keys of a batch: FNV-1a (32 bits) of each key's UTF-8 bytes masked to 31 bits,
-- as txoutbox_key_hash and store.KeyHash compute it, or of the message id's text form for a
-- message without a key (NULL or ''). keys may be NULL (no keys); ids has one element per
-- message. One call hashes the whole batch (a PL/pgSQL call per message cost more than its
-- hash): eight bytes a statement, then the last 0 to 7 in one.
CREATE FUNCTION txoutbox_partition_keys(keys text[], ids uuid[]) RETURNS int4[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $fn$
DECLARE
    out int4[] := '{}';
    b bytea;
    j int;
    h bigint;
BEGIN
    FOR i IN 1 .. cardinality(ids) LOOP
        b := convert_to(coalesce(nullif(keys[i], ''), ids[i]::text), 'UTF8');
        h := 2166136261;
        j := 0;
        WHILE j + 8 <= length(b) LOOP
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
        h := CASE length(b) - j
                 WHEN 1 THEN ((h # get_byte(b, j)) * 16777619 & 4294967295)
                 WHEN 2 THEN ((((h # get_byte(b, j)) * 16777619 & 4294967295)
                              # get_byte(b, j + 1)) * 16777619 & 4294967295)
                 WHEN 3 THEN ((((((h # get_byte(b, j)) * 16777619 & 4294967295)
                                # get_byte(b, j + 1)) * 16777619 & 4294967295)
                                # get_byte(b, j + 2)) * 16777619 & 4294967295)
                 WHEN 4 THEN ((((((((h # get_byte(b, j)) * 16777619 & 4294967295)
                                  # get_byte(b, j + 1)) * 16777619 & 4294967295)
                                  # get_byte(b, j + 2)) * 16777619 & 4294967295)
                                  # get_byte(b, j + 3)) * 16777619 & 4294967295)
                 WHEN 5 THEN ((((((((((h # get_byte(b, j)) * 16777619 & 4294967295)
                                    # get_byte(b, j + 1)) * 16777619 & 4294967295)
                                    # get_byte(b, j + 2)) * 16777619 & 4294967295)
                                    # get_byte(b, j + 3)) * 16777619 & 4294967295)
                                    # get_byte(b, j + 4)) * 16777619 & 4294967295)
                 WHEN 6 THEN ((((((((((((h # get_byte(b, j)) * 16777619 & 4294967295)
                                      # get_byte(b, j + 1)) * 16777619 & 4294967295)
                                      # get_byte(b, j + 2)) * 16777619 & 4294967295)
                                      # get_byte(b, j + 3)) * 16777619 & 4294967295)
                                      # get_byte(b, j + 4)) * 16777619 & 4294967295)
                                      # get_byte(b, j + 5)) * 16777619 & 4294967295)
                 WHEN 7 THEN ((((((((((((((h # get_byte(b, j)) * 16777619 & 4294967295)
                                        # get_byte(b, j + 1)) * 16777619 & 4294967295)
                                        # get_byte(b, j + 2)) * 16777619 & 4294967295)
                                        # get_byte(b, j + 3)) * 16777619 & 4294967295)
                                        # get_byte(b, j + 4)) * 16777619 & 4294967295)
                                        # get_byte(b, j + 5)) * 16777619 & 4294967295)
                                        # get_byte(b, j + 6)) * 16777619 & 4294967295)
                 ELSE h END;
        out := out || (h & 2147483647)::int4;
    END LOOP;
    RETURN out;
END
$fn$;

-- EXECUTE is granted explicitly, not to PUBLIC (004). txoutbox_write calls this function with
-- the caller's privileges: every role that may call txoutbox_write (what txoutbox_enqueue,
-- txoutbox_enqueue_many and txoutbox_prepare reach) gets EXECUTE on it,
-- so that producers granted before this migration keep working without a new grant.
REVOKE EXECUTE ON FUNCTION txoutbox_partition_keys(text[], uuid[]) FROM PUBLIC;
DO $do$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT a.rolname FROM pg_roles a
             WHERE NOT a.rolsuper AND a.rolname NOT LIKE 'pg\_%'
               AND a.oid <> (SELECT p.proowner FROM pg_proc p
                             WHERE p.oid = 'txoutbox_write(text, boolean, text[], bytea[], text[], jsonb[], text[], uuid[], text, text, interval)'::regprocedure)
               AND has_function_privilege(a.oid, 'txoutbox_write(text, boolean, text[], bytea[], text[], jsonb[], text[], uuid[], text, text, interval)'::regprocedure, 'EXECUTE') LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION txoutbox_partition_keys(text[], uuid[]) TO %I', r.rolname);
    END LOOP;
END
$do$;

-- Whether s is a valid subject: as in 004; the first token is compared with the reserved ones
-- only when s starts with '$'.
CREATE OR REPLACE FUNCTION txoutbox_subject_ok(s text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT octet_length(s) BETWEEN 1 AND 1024
   AND s !~ '[\u0001-\u0020\u007f-\u009f]|(^|\.)(\.|$)|(^|\.)[*>](\.|$)'
   AND (ascii(s) <> 36 OR split_part(s, '.', 1) NOT IN ('$JS', '$JSC', '$SYS', '$NRG'))
$fn$;

-- A version 7 UUID (RFC 9562), as in 004: 48 bits of Unix milliseconds, then random bits. The
-- milliseconds are read as double precision (date_part) rather than numeric (extract).
CREATE OR REPLACE FUNCTION txoutbox_uuidv7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $fn$
SELECT encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid())
    PLACING substring(int8send(floor(date_part('epoch', clock_timestamp()) * 1000)::bigint) FROM 3)
    FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid
$fn$;

-- The size of the lines of simple headers, as in 004 (the same result for every text). One
-- header of ASCII text with nothing escaped (no '\'), {"name": ["value"]}, is read with string
-- functions: exactly four '"', at the ends and around the first '": ["', make it one name with
-- one string value. The name must be a token and not reserved; the value must not hold DEL
-- (JSON escapes C0, and C1 is not ASCII) nor begin or end with a space (the only ASCII white
-- space JSON does not escape). Other texts go through 004's regular expressions.
CREATE OR REPLACE FUNCTION txoutbox_simple_headers_size(t text) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT CASE WHEN t = '{}' THEN 0
            WHEN t LIKE '{"%"]}' AND strpos(t, '\') = 0
             AND octet_length(t) - octet_length(replace(t, '"', '')) = 4
             AND strpos(t, '": ["') BETWEEN 3 AND octet_length(t) - 7
             AND octet_length(t) = length(t)
            THEN CASE WHEN substr(t, 3, strpos(t, '": ["') - 3) ~ '^[A-Za-z0-9!#$%&''*+.^_`|~-]+$'
                       AND lower(left(t, 15) COLLATE "C") NOT LIKE ALL (ARRAY['{"nats-%', '{"txoutbox-%', '{"status"%', '{"description"%'])
                       AND strpos(t, chr(127)) = 0 AND t NOT LIKE '%": [" %' AND t NOT LIKE '% "]}'
                      THEN octet_length(t) - 6 END
            WHEN t ~ ('^\{' || txoutbox_simple_header_re() || '(, ' || txoutbox_simple_header_re() || ')*\}$')
             AND t !~* '"(nats-[^"]*|txoutbox-[^"]*|status|description)": \['
            THEN octet_length(t) - 6 * ((octet_length(t) - octet_length(replace(t, '"', ''))) / 4)
       END
$fn$;

-- Checks and writes messages, as in 004, but for the partition keys: they are hashed after the
-- checks, in one call for the batch (txoutbox_partition_keys), and the keys locked are those
-- of the messages with a key, as before (txoutbox_lock_key_hashes sorts them).
CREATE OR REPLACE FUNCTION txoutbox_write(fn text, numbered boolean, subjects text[], payloads bytea[], keys text[],
    headers jsonb[], biz_keys text[], ids uuid[], producer_group text, check_mode text, check_immunity interval)
RETURNS uuid[]
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $fn$
DECLARE
    n int := cardinality(subjects);
    given_ids boolean := coalesce(cardinality(array_remove(ids, NULL)), 0) > 0;
    bad int;
    dup int;
    hsizes int[];
    out_ids uuid[];
    out_parts int4[];
    keyed boolean;
    done uuid[];
    ctx text;
BEGIN
    SELECT min(c.ord) FILTER (WHERE c.ok IS NOT TRUE), array_agg(c.hsize ORDER BY c.ord),
           array_agg(c.mid ORDER BY c.ord), bool_or(c.k IS NOT NULL)
      INTO bad, hsizes, out_ids, keyed
    FROM (SELECT m.ord, m.k, m.mid, m.hsize,
                 txoutbox_subject_ok(m.subject) AND txoutbox_key_ok(m.k) AND txoutbox_key_ok(m.bk) AND m.hsize >= 0
                 AND txoutbox_header_block(m.hsize, m.k, m.bk) <= 61439
                 AND coalesce(octet_length(m.payload), 0) + txoutbox_header_block(m.hsize, m.k, m.bk) <= 1048576 AS ok
          FROM (SELECT t.*,
                       -- The size of the headers' lines, -1 when they are invalid: from their
                       -- text when it is simple, else header by header, value by value.
                       CASE WHEN t.hdr IS NULL THEN 0
                            WHEN t.hdr_text IS NULL THEN -1
                            ELSE coalesce(txoutbox_simple_headers_size(t.hdr_text), (
                                SELECT CASE WHEN bool_and(txoutbox_header_name_ok(e.key) AND jsonb_typeof(e.value) = 'array'
                                                          AND jsonb_array_length(e.value) > 0 AND txoutbox_header_value_ok(v.value)) IS NOT FALSE
                                            THEN coalesce(sum(octet_length(e.key) + 4 + octet_length(v.value #>> '{}')), 0)::int
                                            ELSE -1 END
                                FROM jsonb_each(t.hdr) e
                                LEFT JOIN LATERAL jsonb_array_elements(CASE WHEN jsonb_typeof(e.value) = 'array' THEN e.value END) v(value) ON true))
                       END AS hsize
                FROM (SELECT u.ord, u.subject, u.payload, nullif(u.key, '') AS k, nullif(u.biz_key, '') AS bk, u.hdr,
                             CASE WHEN jsonb_typeof(u.hdr) = 'object' THEN u.hdr::text END AS hdr_text,
                             coalesce(u.id, txoutbox_uuidv7()) AS mid
                      FROM unnest(subjects, payloads, keys, headers, biz_keys, ids) WITH ORDINALITY
                           AS u(subject, payload, key, hdr, biz_key, id, ord)
                      OFFSET 0) t
                OFFSET 0) m) c;
    IF given_ids THEN
        SELECT min(d.ord) INTO dup
        FROM (SELECT u.ord, row_number() OVER (PARTITION BY u.id ORDER BY u.ord) AS seen
              FROM unnest(ids) WITH ORDINALITY AS u(id, ord) WHERE u.id IS NOT NULL) d
        WHERE d.seen > 1;
    END IF;
    IF bad IS NOT NULL OR dup IS NOT NULL THEN
        bad := least(bad, dup);
        ctx := fn || ': ' || CASE WHEN numbered THEN format('message %s: ', bad) ELSE '' END;
        PERFORM txoutbox_check_message(ctx, subjects[bad], payloads[bad], nullif(keys[bad], ''), headers[bad],
                                       nullif(biz_keys[bad], ''), hsizes[bad]);
        IF bad = dup THEN
            RAISE EXCEPTION USING ERRCODE = 'TX006',
                MESSAGE = format('%sid: duplicate message id: message %s of this call has the same id %s', ctx, array_position(ids, ids[bad]), ids[bad]);
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'XX000',
            MESSAGE = format('%stxoutbox internal error: the batch check refused the message and txoutbox_check_message found nothing wrong', ctx);
    END IF;
    out_parts := txoutbox_partition_keys(keys, out_ids);
    IF check_mode IS NULL AND keyed THEN
        PERFORM txoutbox_lock_key_hashes(ARRAY(SELECT u.p FROM unnest(keys, out_parts) AS u(k, p) WHERE u.k <> ''));
    END IF;
    IF check_mode IS NULL AND NOT given_ids THEN
        -- Ready messages with ids drawn here (UUIDv7, no collision): EnqueueTx's statement.
        INSERT INTO txoutbox_messages (message_id, subject, msg_key, partition_key, headers, payload, state, ready_at)
        SELECT u.message_id, u.subject, nullif(u.msg_key, ''), u.partition_key,
               txoutbox_stored_headers(u.headers, nullif(u.biz_key, '')), coalesce(u.payload, '\x'::bytea),
               'ready', clock_timestamp()
        FROM unnest(out_ids, subjects, keys, out_parts, headers, biz_keys, payloads) WITH ORDINALITY
             AS u(message_id, subject, msg_key, partition_key, headers, biz_key, payload, ord)
        ORDER BY u.ord;
        RETURN out_ids;
    END IF;
    -- A caller's id may already be in the outbox: skip the conflict, then say which.
    WITH ins AS (
        INSERT INTO txoutbox_messages (message_id, subject, msg_key, partition_key, headers, payload, state, ready_at,
            producer_group, check_mode, next_check_at)
        SELECT u.message_id, u.subject, nullif(u.msg_key, ''), u.partition_key,
               txoutbox_stored_headers(u.headers, nullif(u.biz_key, '')), coalesce(u.payload, '\x'::bytea),
               CASE WHEN check_mode IS NULL THEN 'ready' ELSE 'prepared' END,
               CASE WHEN check_mode IS NULL THEN clock_timestamp() END,
               producer_group, check_mode,
               CASE WHEN check_mode IS NOT NULL THEN now() + greatest(coalesce(check_immunity, interval '0'), interval '0') END
        FROM unnest(out_ids, subjects, keys, out_parts, headers, biz_keys, payloads) WITH ORDINALITY
             AS u(message_id, subject, msg_key, partition_key, headers, biz_key, payload, ord)
        ORDER BY u.ord
        ON CONFLICT ON CONSTRAINT txoutbox_messages_message_id_key DO NOTHING
        RETURNING message_id
    )
    SELECT array_agg(message_id) INTO done FROM ins;
    IF coalesce(cardinality(done), 0) <> n THEN
        FOR i IN 1 .. n LOOP
            IF NOT (out_ids[i] = ANY(coalesce(done, '{}'))) THEN
                RAISE EXCEPTION USING ERRCODE = 'TX006',
                    MESSAGE = format('%s: %sid: duplicate message id: a message with id %s is already in the outbox',
                                     fn, CASE WHEN numbered THEN format('message %s: ', i) ELSE '' END, out_ids[i]);
            END IF;
        END LOOP;
    END IF;
    RETURN out_ids;
END
$fn$;

-- txoutbox_enqueue and txoutbox_enqueue_many as in 005; without a delivery time they call
-- txoutbox_write directly, as txoutbox_enqueue_v4 and txoutbox_enqueue_many_v4 do (the same
-- argument checks and errors).
CREATE OR REPLACE FUNCTION txoutbox_enqueue(subject text, payload bytea, key text DEFAULT NULL, headers jsonb DEFAULT NULL,
    biz_key text DEFAULT NULL, id uuid DEFAULT NULL, deliver_at timestamptz DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    mid uuid;
BEGIN
    IF deliver_at IS NULL THEN
        RETURN (txoutbox_write('txoutbox_enqueue', false, ARRAY[subject], ARRAY[payload], ARRAY[key], ARRAY[headers],
                               ARRAY[biz_key], ARRAY[id], NULL, NULL, NULL))[1];
    END IF;
    -- The message's own checks first, as EnqueueTx makes them (an error undoes the insert).
    mid := txoutbox_enqueue_v4(subject, payload, key, headers, biz_key, id);
    PERFORM txoutbox_check_deliver_at('txoutbox_enqueue', deliver_at);
    UPDATE txoutbox_messages m SET state = 'scheduled', ready_at = NULL, deliver_at = txoutbox_enqueue.deliver_at
    WHERE m.message_id = mid;
    RETURN mid;
END
$fn$;

CREATE OR REPLACE FUNCTION txoutbox_enqueue_many(subjects text[], payloads bytea[], keys text[] DEFAULT NULL,
    headers jsonb[] DEFAULT NULL, biz_keys text[] DEFAULT NULL, ids uuid[] DEFAULT NULL, deliver_ats timestamptz[] DEFAULT NULL)
RETURNS uuid[]
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    n int := coalesce(cardinality(subjects), 0);
    out_ids uuid[];
    bad int;
BEGIN
    IF deliver_ats IS NULL THEN
        -- txoutbox_enqueue_many_v4, inline.
        IF n = 0 THEN
            RETURN '{}';
        END IF;
        IF array_ndims(subjects) <> 1 OR coalesce(cardinality(payloads), 0) <> n OR array_ndims(payloads) <> 1
           OR (keys IS NOT NULL AND (cardinality(keys) <> n OR array_ndims(keys) <> 1))
           OR (headers IS NOT NULL AND (cardinality(headers) <> n OR array_ndims(headers) <> 1))
           OR (biz_keys IS NOT NULL AND (cardinality(biz_keys) <> n OR array_ndims(biz_keys) <> 1))
           OR (ids IS NOT NULL AND (cardinality(ids) <> n OR array_ndims(ids) <> 1)) THEN
            RAISE EXCEPTION USING ERRCODE = 'TX008',
                MESSAGE = format('txoutbox_enqueue_many: invalid argument: subjects has %s elements; payloads, and keys, headers, biz_keys and ids when not NULL, must have as many (one-dimensional arrays)', n);
        END IF;
        RETURN txoutbox_write('txoutbox_enqueue_many', true, subjects, payloads, keys, headers, biz_keys, ids, NULL, NULL, NULL);
    END IF;
    IF coalesce(cardinality(deliver_ats), 0) <> coalesce(cardinality(subjects), 0) THEN
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = format('txoutbox_enqueue_many: deliver_ats: invalid argument: %s delivery times for %s subjects',
                coalesce(cardinality(deliver_ats), 0), coalesce(cardinality(subjects), 0));
    END IF;
    IF NOT EXISTS (SELECT 1 FROM unnest(deliver_ats) d WHERE d IS NOT NULL) THEN
        RETURN txoutbox_enqueue_many_v4(subjects, payloads, keys, headers, biz_keys, ids);
    END IF;
    -- The messages' own checks first (an error undoes the inserts); then the delivery times.
    -- (EnqueueTx checks message by message: with one message bad in its content and an
    -- earlier one bad in its delivery time only, the two name different messages.)
    out_ids := txoutbox_enqueue_many_v4(subjects, payloads, keys, headers, biz_keys, ids);
    SELECT min(o) INTO bad FROM unnest(deliver_ats) WITH ORDINALITY AS u(d, o)
    WHERE d IS NOT NULL AND (d < '1970-01-01 00:00:00+00' OR d > '9999-12-31 23:59:59+00');
    IF bad IS NOT NULL THEN
        PERFORM txoutbox_check_deliver_at(format('txoutbox_enqueue_many: message %s', bad - 1), deliver_ats[bad]);
    END IF;
    UPDATE txoutbox_messages m SET state = 'scheduled', ready_at = NULL, deliver_at = u.d
    FROM unnest(out_ids, deliver_ats) AS u(id, d)
    WHERE m.message_id = u.id AND u.d IS NOT NULL;
    RETURN out_ids;
END
$fn$;

-- txoutbox_prepare refuses a negative check_immunity (TX008), as outbox.Prepare refuses a
-- negative PrepareOptions.CheckImmunity; before, it counted as none.
CREATE OR REPLACE FUNCTION txoutbox_prepare(subject text, payload bytea, key text DEFAULT NULL, headers jsonb DEFAULT NULL,
    biz_key text DEFAULT NULL, id uuid DEFAULT NULL, producer_group text DEFAULT NULL, fence boolean DEFAULT false,
    check_immunity interval DEFAULT NULL, deliver_at timestamptz DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    mid uuid;
BEGIN
    IF check_immunity < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = format('txoutbox_prepare: check_immunity: invalid argument: must not be negative (0 or NULL: checked from the check-back''s transaction timeout on), got %s', check_immunity);
    END IF;
    mid := txoutbox_prepare_v4(subject, payload, key, headers, biz_key, id, producer_group, fence, check_immunity);
    IF deliver_at IS NOT NULL THEN
        PERFORM txoutbox_check_deliver_at('txoutbox_prepare', deliver_at);
        UPDATE txoutbox_messages m SET deliver_at = txoutbox_prepare.deliver_at WHERE m.message_id = mid;
    END IF;
    RETURN mid;
END
$fn$;
