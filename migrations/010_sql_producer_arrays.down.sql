-- Reverts 010: migration 009's txoutbox_write, txoutbox_check_message, txoutbox_cancel_biz_key
-- and txoutbox_reschedule_biz_key, 008's txoutbox_uuidv7s, 007's txoutbox_partition_keys and
-- 005's txoutbox_raise_not_scheduled; txoutbox_fnv and the traceparent checks dropped.

-- 009's txoutbox_write.
CREATE OR REPLACE FUNCTION txoutbox_write(fn text, numbered boolean, subjects text[], payloads bytea[], keys text[],
    headers jsonb[], biz_keys text[], ids uuid[], deliver_ats timestamptz[], producer_group text, check_mode text,
    check_immunity interval)
RETURNS uuid[]
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $fn$
DECLARE
    n int := cardinality(subjects);
    given_ids boolean;
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
    max_bytes int := txoutbox_max_message_bytes();
BEGIN
    -- The all-zero UUID is no id, as uuid.Nil is for EnqueueTx: one is drawn for it.
    ids := array_replace(ids, '00000000-0000-0000-0000-000000000000'::uuid, NULL);
    given_ids := coalesce(cardinality(array_remove(ids, NULL)), 0) > 0;
    -- Ids for the messages without one, drawn for the whole call.
    IF ids IS NULL OR cardinality(ids) < n OR array_position(ids, NULL) IS NOT NULL THEN
        drawn := txoutbox_uuidv7s(greatest(n, coalesce(cardinality(ids), 0)));
    END IF;
    out_ids := CASE WHEN given_ids
                    THEN ARRAY(SELECT coalesce(u.id, drawn[u.ord]) FROM unnest(subjects, ids) WITH ORDINALITY AS u(s, id, ord) ORDER BY u.ord)
                    ELSE drawn END;
    -- The first message refused, and the sizes of the headers of the messages refused (the
    -- first's is bad_hsizes[1]): nothing is sorted or collected for a batch without one.
    -- keyed: a message to lock a key for (keyed, not delayed).
    SELECT min(c.ord) FILTER (WHERE c.ok IS NOT TRUE), array_agg(c.hsize ORDER BY c.ord) FILTER (WHERE c.ok IS NOT TRUE),
           bool_or(c.k IS NOT NULL AND c.d IS NULL)
      INTO bad, bad_hsizes, keyed
    FROM (SELECT m.ord, m.k, m.d, m.hsize,
                 txoutbox_subject_ok(m.subject) AND txoutbox_key_ok(m.k) AND txoutbox_key_ok(m.bk) AND m.hsize >= 0
                 AND txoutbox_header_block(m.hsize, m.k, m.bk) <= 61439
                 AND coalesce(octet_length(m.payload), 0) + txoutbox_header_block(m.hsize, m.k, m.bk) <= max_bytes
                 AND txoutbox_deliver_at_ok(m.d) AS ok
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
                FROM (SELECT u.ord, u.subject, u.payload, nullif(u.key, '') AS k, nullif(u.biz_key, '') AS bk, u.hdr, u.d,
                             CASE WHEN jsonb_typeof(u.hdr) = 'object' THEN u.hdr::text END AS hdr_text
                      FROM unnest(subjects, payloads, keys, headers, biz_keys, ids, deliver_ats) WITH ORDINALITY
                           AS u(subject, payload, key, hdr, biz_key, id, d, ord)
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
        ctx := fn || CASE WHEN numbered THEN format(': message %s', first) ELSE '' END;
        -- The first message refused: its content, then its delivery time, then its id (which an
        -- earlier message of the call has), as EnqueueTx checks them.
        IF first = bad THEN
            PERFORM txoutbox_check_message(ctx || ': ', subjects[bad], payloads[bad], nullif(keys[bad], ''), headers[bad],
                                           nullif(biz_keys[bad], ''), bad_hsizes[1]);
            IF deliver_ats[bad] IS NOT NULL THEN
                PERFORM txoutbox_check_deliver_at(ctx, deliver_ats[bad]);
            END IF;
        END IF;
        IF first = dup THEN
            RAISE EXCEPTION USING ERRCODE = 'TX006',
                MESSAGE = format('%s: id: duplicate message id: message %s of this call has the same id %s', ctx, array_position(ids, ids[first]), ids[first]);
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'XX000',
            MESSAGE = format('%s: txoutbox internal error: the batch check refused the message and txoutbox_check_message found nothing wrong', ctx);
    END IF;
    out_parts := txoutbox_partition_keys(keys, out_ids);
    IF check_mode IS NULL AND keyed THEN
        -- The keys of the ready messages: a delayed one is locked when it falls due.
        PERFORM txoutbox_lock_key_hashes(ARRAY(SELECT u.p FROM unnest(keys, out_parts, deliver_ats) AS u(k, p, d)
                                               WHERE u.k <> '' AND u.d IS NULL));
    END IF;
    IF check_mode IS NULL AND NOT given_ids THEN
        -- Messages with ids drawn here (UUIDv7, no collision): EnqueueTx's statement.
        INSERT INTO txoutbox_messages (message_id, subject, msg_key, partition_key, headers, payload, state, ready_at, deliver_at)
        SELECT u.message_id, u.subject, nullif(u.msg_key, ''), u.partition_key,
               txoutbox_stored_headers(u.headers, nullif(u.biz_key, '')), coalesce(u.payload, '\x'::bytea),
               CASE WHEN u.d IS NULL THEN 'ready' ELSE 'scheduled' END,
               CASE WHEN u.d IS NULL THEN clock_timestamp() END, u.d
        FROM unnest(out_ids, subjects, keys, out_parts, headers, biz_keys, payloads, deliver_ats) WITH ORDINALITY
             AS u(message_id, subject, msg_key, partition_key, headers, biz_key, payload, d, ord)
        ORDER BY u.ord;
        RETURN out_ids;
    END IF;
    -- A caller's id may already be in the outbox: skip the conflict, then say which.
    WITH ins AS (
        INSERT INTO txoutbox_messages (message_id, subject, msg_key, partition_key, headers, payload, state, ready_at,
            producer_group, check_mode, next_check_at, deliver_at)
        SELECT u.message_id, u.subject, nullif(u.msg_key, ''), u.partition_key,
               txoutbox_stored_headers(u.headers, nullif(u.biz_key, '')), coalesce(u.payload, '\x'::bytea),
               CASE WHEN check_mode IS NOT NULL THEN 'prepared' WHEN u.d IS NULL THEN 'ready' ELSE 'scheduled' END,
               CASE WHEN check_mode IS NULL AND u.d IS NULL THEN clock_timestamp() END,
               producer_group, check_mode,
               CASE WHEN check_mode IS NOT NULL THEN now() + greatest(coalesce(check_immunity, interval '0'), interval '0') END,
               u.d
        FROM unnest(out_ids, subjects, keys, out_parts, headers, biz_keys, payloads, deliver_ats) WITH ORDINALITY
             AS u(message_id, subject, msg_key, partition_key, headers, biz_key, payload, d, ord)
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

-- 005's txoutbox_raise_not_scheduled.
CREATE OR REPLACE FUNCTION txoutbox_raise_not_scheduled(fn text, p_id uuid, st text) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $fn$
BEGIN
    IF st = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX201',
            MESSAGE = format('%s: id: message %s is not scheduled: message not found', fn, p_id);
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'TX201',
        MESSAGE = format('%s: id: message %s is %s: message is not scheduled', fn, p_id, st);
END
$fn$;

-- 007's txoutbox_partition_keys (PL/pgSQL: CREATE OR REPLACE may change the language).
CREATE OR REPLACE FUNCTION txoutbox_partition_keys(keys text[], ids uuid[]) RETURNS int4[]
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

DROP FUNCTION txoutbox_fnv(bigint, bytea);

-- 008's txoutbox_uuidv7s.
CREATE OR REPLACE FUNCTION txoutbox_uuidv7s(n bigint) RETURNS uuid[]
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

-- 009's txoutbox_check_message.
CREATE OR REPLACE FUNCTION txoutbox_check_message(ctx text, subject text, payload bytea, key text, headers jsonb, biz_key text,
    hsize int)
RETURNS void
LANGUAGE plpgsql STABLE AS $fn$
DECLARE
    what text;
    name text;
    vals jsonb;
    v jsonb;
    j int;
    block int;
    total bigint;
BEGIN
    -- Subject: outbox.ValidateSubject.
    IF subject IS NULL OR subject = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX001', MESSAGE = ctx || 'subject: invalid subject: subject is empty';
    END IF;
    IF octet_length(subject) > 1024 THEN
        RAISE EXCEPTION USING ERRCODE = 'TX001',
            MESSAGE = format('%ssubject: invalid subject: subject is %s bytes, the limit is 1024', ctx, octet_length(subject));
    END IF;
    IF subject ~ '[\u0001-\u0020\u007f-\u009f]' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX001',
            MESSAGE = ctx || 'subject: invalid subject: white space or a control character (C0, DEL, C1)';
    END IF;
    IF subject ~ '(^|\.)(\.|$)' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX001', MESSAGE = ctx || 'subject: invalid subject: a token is empty';
    END IF;
    IF subject ~ '(^|\.)[*>](\.|$)' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX001',
            MESSAGE = ctx || 'subject: invalid subject: a token is a wildcard (* or >); publish subjects must be literal';
    END IF;
    IF split_part(subject, '.', 1) IN ('$JS', '$JSC', '$SYS', '$NRG') THEN
        RAISE EXCEPTION USING ERRCODE = 'TX001',
            MESSAGE = format('%ssubject: invalid subject: subjects starting with %s are reserved for NATS (the JetStream API, the system account, Raft): a message there would act on the server',
                             ctx, split_part(subject, '.', 1));
    END IF;
    -- Key and business key: outbox.ValidateKey.
    IF key IS NOT NULL THEN
        what := CASE WHEN octet_length(key) > 1024 THEN format('is %s bytes, the limit is 1024', octet_length(key))
                     ELSE txoutbox_text_problem(key, false) END;
        IF what IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'TX002', MESSAGE = ctx || 'key: invalid key: key ' || what;
        END IF;
    END IF;
    IF biz_key IS NOT NULL THEN
        what := CASE WHEN octet_length(biz_key) > 1024 THEN format('is %s bytes, the limit is 1024', octet_length(biz_key))
                     ELSE txoutbox_text_problem(biz_key, false) END;
        IF what IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'TX002', MESSAGE = ctx || 'biz_key: invalid key: biz_key ' || what;
        END IF;
    END IF;
    -- Headers: a JSON object of name: [values], names valid (txoutbox_header_name_ok), each
    -- with at least one value, values valid (txoutbox_header_value_ok). Names in byte order,
    -- values in array order: the first problem found is the one reported.
    IF headers IS NOT NULL AND jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX003',
            MESSAGE = format('%sheaders: invalid header: want a JSON object of name: [values], got a JSON %s', ctx, jsonb_typeof(headers));
    END IF;
    IF hsize < 0 THEN
        FOR name, vals IN SELECT e.key, e.value FROM jsonb_each(headers) e ORDER BY e.key COLLATE "C" LOOP
            IF name !~ '^[A-Za-z0-9!#$%&''*+.^_`|~-]+$' THEN
                RAISE EXCEPTION USING ERRCODE = 'TX003',
                    MESSAGE = format('%sheaders: invalid header: name %s is not a valid header name (letters, digits and !#$%%&''*+-.^_`|~ only)', ctx, to_jsonb(name));
            END IF;
            what := CASE
                WHEN lower(name COLLATE "C") = 'nats-msg-id' THEN 'Nats-Msg-Id is set by the relay to the message id; pass the id argument instead'
                WHEN lower(name COLLATE "C") = 'txoutbox-key' THEN 'Txoutbox-Key is set by the relay; pass the key argument instead'
                WHEN lower(name COLLATE "C") = 'txoutbox-biz-key' THEN 'Txoutbox-Biz-Key is set from the biz_key argument; pass that instead'
                WHEN lower(name COLLATE "C") LIKE 'nats-%' THEN 'Nats-* headers are reserved for NATS (the server acts on them at publish); use a name of your own'
                WHEN lower(name COLLATE "C") LIKE 'txoutbox-%' THEN 'Txoutbox-* headers are reserved for txoutbox; use a name of your own'
                WHEN lower(name COLLATE "C") IN ('status', 'description') THEN 'Status and Description are NATS status headers; use another name'
            END;
            IF what IS NOT NULL THEN
                RAISE EXCEPTION USING ERRCODE = 'TX003',
                    MESSAGE = format('%sheaders: invalid header: %s is reserved: %s', ctx, to_jsonb(name), what);
            END IF;
            IF jsonb_typeof(vals) <> 'array' THEN
                RAISE EXCEPTION USING ERRCODE = 'TX003',
                    MESSAGE = format('%sheaders: invalid header: %s: want an array of string values, got a JSON %s', ctx, to_jsonb(name), jsonb_typeof(vals));
            END IF;
            IF jsonb_array_length(vals) = 0 THEN
                RAISE EXCEPTION USING ERRCODE = 'TX003',
                    MESSAGE = format('%sheaders: invalid header: %s has no value and would not arrive; give it one ("" if need be) or leave it out', ctx, to_jsonb(name));
            END IF;
            j := 0;
            FOR v IN SELECT jsonb_array_elements(vals) LOOP
                j := j + 1;
                IF jsonb_typeof(v) <> 'string' THEN
                    RAISE EXCEPTION USING ERRCODE = 'TX003',
                        MESSAGE = format('%sheaders: invalid header: value %s of %s is a JSON %s, want a string', ctx, j, to_jsonb(name), jsonb_typeof(v));
                END IF;
                what := txoutbox_text_problem(v #>> '{}', true);
                IF what IS NOT NULL THEN
                    RAISE EXCEPTION USING ERRCODE = 'TX003',
                        MESSAGE = format('%sheaders: invalid header: value %s of %s %s', ctx, j, to_jsonb(name), what);
                END IF;
            END LOOP;
        END LOOP;
        -- Not reached: txoutbox_header_name_ok and txoutbox_header_value_ok refuse nothing
        -- the loop above accepts.
        RAISE EXCEPTION USING ERRCODE = 'TX003', MESSAGE = ctx || 'headers: invalid header';
    END IF;
    -- Sizes as NATS counts them: the block at most outbox.MaxHeaderBytes (61439), the whole
    -- message at most txoutbox_max_message_bytes().
    block := txoutbox_header_block(coalesce(hsize, 0), key, biz_key);
    IF block > 61439 THEN
        RAISE EXCEPTION USING ERRCODE = 'TX004',
            MESSAGE = format('%sheaders: header block too large: the header block NATS stores (the headers, the relay''s Nats-Msg-Id, Txoutbox-Key and Txoutbox-Biz-Key, and framing) is %s bytes, the limit is 61439 bytes (nats-server stores at most 65535 whatever the payload, and a consumer''s dead letter of the message adds up to 4096)', ctx, block);
    END IF;
    total := coalesce(octet_length(payload), 0)::bigint + block;
    IF total > txoutbox_max_message_bytes() THEN
        RAISE EXCEPTION USING ERRCODE = 'TX005',
            MESSAGE = format('%spayload: message too large: payload %s bytes + headers = %s bytes, over the limit of %s bytes (NATS counts headers, including the relay''s; the setting txoutbox.max_message_bytes)',
                             ctx, coalesce(octet_length(payload), 0), total, txoutbox_max_message_bytes());
    END IF;
END
$fn$;

DROP FUNCTION txoutbox_traceparent_problem(text);
DROP FUNCTION txoutbox_traceparent_value_ok(text);

-- 009's txoutbox_cancel_biz_key and txoutbox_reschedule_biz_key.
CREATE OR REPLACE FUNCTION txoutbox_cancel_biz_key(biz_key text) RETURNS uuid[]
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    ids uuid[];
BEGIN
    IF biz_key IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = 'txoutbox_cancel_biz_key: biz_key: invalid argument: biz_key is NULL: pass the business key of the scheduled messages';
    END IF;
    IF biz_key = '' OR NOT txoutbox_key_ok(biz_key) THEN
        RAISE EXCEPTION USING ERRCODE = 'TX002',
            MESSAGE = 'txoutbox_cancel_biz_key: biz_key: invalid key: biz_key '
                      || CASE WHEN biz_key = '' THEN 'is empty: pass the business key of the scheduled messages'
                              WHEN octet_length(biz_key) > 1024 THEN format('is %s bytes, the limit is 1024', octet_length(biz_key))
                              ELSE txoutbox_text_problem(biz_key, false) END;
    END IF;
    WITH d AS (
        UPDATE txoutbox_messages m SET state = 'rolled_back', settled_by = 'cancel', settled_at = clock_timestamp()
        WHERE m.message_id = ANY (ARRAY(SELECT s.message_id FROM txoutbox_messages s
                                        WHERE (s.headers -> 'Txoutbox-Biz-Key' ->> 0) = txoutbox_cancel_biz_key.biz_key
                                          AND s.state = 'scheduled'))
          AND m.state = 'scheduled'
        RETURNING m.message_id
    )
    SELECT array_agg(d.message_id) INTO ids FROM d;
    IF ids IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'TX201',
            MESSAGE = format('txoutbox_cancel_biz_key: biz_key: no message of business key %L is scheduled: message is not scheduled', biz_key);
    END IF;
    RETURN ids;
END
$fn$;

CREATE OR REPLACE FUNCTION txoutbox_reschedule_biz_key(biz_key text, deliver_at timestamptz) RETURNS uuid[]
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    ids uuid[];
BEGIN
    IF biz_key IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = 'txoutbox_reschedule_biz_key: biz_key: invalid argument: biz_key is NULL: pass the business key of the scheduled messages';
    END IF;
    IF biz_key = '' OR NOT txoutbox_key_ok(biz_key) THEN
        RAISE EXCEPTION USING ERRCODE = 'TX002',
            MESSAGE = 'txoutbox_reschedule_biz_key: biz_key: invalid key: biz_key '
                      || CASE WHEN biz_key = '' THEN 'is empty: pass the business key of the scheduled messages'
                              WHEN octet_length(biz_key) > 1024 THEN format('is %s bytes, the limit is 1024', octet_length(biz_key))
                              ELSE txoutbox_text_problem(biz_key, false) END;
    END IF;
    PERFORM txoutbox_check_deliver_at('txoutbox_reschedule_biz_key', deliver_at);
    WITH u AS (
        UPDATE txoutbox_messages m SET deliver_at = txoutbox_reschedule_biz_key.deliver_at, settled_at = clock_timestamp()
        WHERE m.message_id = ANY (ARRAY(SELECT s.message_id FROM txoutbox_messages s
                                        WHERE (s.headers -> 'Txoutbox-Biz-Key' ->> 0) = txoutbox_reschedule_biz_key.biz_key
                                          AND s.state = 'scheduled'))
          AND m.state = 'scheduled'
        RETURNING m.message_id
    )
    SELECT array_agg(u.message_id) INTO ids FROM u;
    IF ids IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'TX201',
            MESSAGE = format('txoutbox_reschedule_biz_key: biz_key: no message of business key %L is scheduled: message is not scheduled', biz_key);
    END IF;
    RETURN ids;
END
$fn$;
