-- txoutbox 008: the ids the SQL producer functions draw cost one random draw per call, not
-- one per message. Drawing 100 UUIDv7s with txoutbox_uuidv7() (strong random bytes from
-- gen_random_uuid each time) was about a fifth of txoutbox_enqueue_many's server CPU for 100
-- messages. txoutbox_write's check statement also stops collecting, and sorting, what only a
-- refused message needs: the ids come from txoutbox_uuidv7s, and the sizes of the headers
-- are collected for the messages refused alone. The rules, errors and order of the checks do
-- not change.

-- n version 7 UUIDs for one call, in RFC 9562's monotonic random form (section 6.2,
-- method 2): all share the call's millisecond (unix_ts_ms) and 12 random bits (rand_a), and
-- the i-th (1-based) gets 61 random bits plus i in rand_b, whose top bit is left clear so that
-- the count never carries into the variant. They are unique (73 random bits a call, and the
-- ordinal within it), of the RFC 9562 variant, and increase in their order. NULL for NULL.
CREATE FUNCTION txoutbox_uuidv7s(n bigint) RETURNS uuid[]
LANGUAGE plpgsql VOLATILE STRICT PARALLEL SAFE AS $fn$
DECLARE
    r bytea := uuid_send(gen_random_uuid());
    -- unix_ts_ms, ver (7) and rand_a.
    hi bigint := (floor(date_part('epoch', clock_timestamp()) * 1000)::bigint << 16) | 28672
                 | ((get_byte(r, 6) & 15) << 8) | get_byte(r, 7);
    -- var (10) and rand_b's 61 random bits.
    lo bigint := (('x' || encode(substring(r FROM 9 FOR 8), 'hex'))::bit(64)::bigint & 2305843009213693951)
                 | (-9223372036854775808);
BEGIN
    RETURN ARRAY(SELECT encode(int8send(hi) || int8send(lo + g), 'hex')::uuid FROM generate_series(1, n) g ORDER BY g);
END
$fn$;

-- EXECUTE is granted explicitly, not to PUBLIC (004), to every role that may call
-- txoutbox_write (which calls this function with the caller's privileges): producers granted
-- before this migration keep working, and so does the owner of the earlier migrations' functions
-- when another role (an operator, a superuser) runs this one. Migration 007 granted
-- txoutbox_partition_keys the same way but passed over txoutbox_write's owner, which only
-- worked when one role ran both: roles that may call txoutbox_write and not
-- txoutbox_partition_keys get it here too (008's down migration leaves that grant: it only lets
-- them do what txoutbox_write already allowed).
REVOKE EXECUTE ON FUNCTION txoutbox_uuidv7s(bigint) FROM PUBLIC;
DO $do$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT a.rolname, f.fn FROM pg_roles a
             CROSS JOIN (VALUES ('txoutbox_uuidv7s(bigint)'::regprocedure),
                                ('txoutbox_partition_keys(text[], uuid[])'::regprocedure)) AS f(fn)
             WHERE NOT a.rolsuper AND a.rolname NOT LIKE 'pg\_%'
               AND has_function_privilege(a.oid, 'txoutbox_write(text, boolean, text[], bytea[], text[], jsonb[], text[], uuid[], text, text, interval)'::regprocedure, 'EXECUTE')
               AND NOT has_function_privilege(a.oid, f.fn, 'EXECUTE') LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', r.fn, r.rolname);
    END LOOP;
END
$do$;

-- Checks and writes messages, as in 007, with ids drawn by txoutbox_uuidv7s and the sizes of the
-- headers collected for the messages refused only.
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
    first int;
    bad_hsizes int[];
    out_ids uuid[];
    out_parts int4[];
    keyed boolean;
    done uuid[];
    ctx text;
    drawn uuid[];
BEGIN
    -- Ids for the messages without one, drawn for the whole call.
    IF ids IS NULL OR cardinality(ids) < n OR array_position(ids, NULL) IS NOT NULL THEN
        drawn := txoutbox_uuidv7s(greatest(n, coalesce(cardinality(ids), 0)));
    END IF;
    out_ids := CASE WHEN given_ids
                    THEN ARRAY(SELECT coalesce(u.id, drawn[u.ord]) FROM unnest(subjects, ids) WITH ORDINALITY AS u(s, id, ord) ORDER BY u.ord)
                    ELSE drawn END;
    -- The first message refused, and the sizes of the headers of the messages refused (the
    -- first's is bad_hsizes[1]): nothing is sorted or collected for a batch without one.
    SELECT min(c.ord) FILTER (WHERE c.ok IS NOT TRUE), array_agg(c.hsize ORDER BY c.ord) FILTER (WHERE c.ok IS NOT TRUE),
           bool_or(c.k IS NOT NULL)
      INTO bad, bad_hsizes, keyed
    FROM (SELECT m.ord, m.k, m.hsize,
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
                             CASE WHEN jsonb_typeof(u.hdr) = 'object' THEN u.hdr::text END AS hdr_text
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
        first := least(bad, dup);
        ctx := fn || ': ' || CASE WHEN numbered THEN format('message %s: ', first) ELSE '' END;
        -- (A message refused only for its id, which an earlier one of the call has, has nothing
        -- wrong for txoutbox_check_message to find.)
        IF first = bad THEN
            PERFORM txoutbox_check_message(ctx, subjects[bad], payloads[bad], nullif(keys[bad], ''), headers[bad],
                                           nullif(biz_keys[bad], ''), bad_hsizes[1]);
        END IF;
        bad := first;
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
