-- txoutbox 010: the SQL producer functions take arrays numbered from any index, and JSON
-- null headers; a cancel or reschedule of a message that does not exist has a code of its own;
-- a traceparent that is not a W3C trace context is refused; and a batch costs less server CPU.
--   * Arrays whose lower bound is not 1 ('[0:1]={k1,k2}', what a PL/pgSQL producer filling
--     s[i] from 0 makes): txoutbox_write paired unnest's positions with subscripts, so it
--     stored a key with another message's partition key, locked the wrong keys, and raised an
--     internal error (XX000) for a bad message instead of its own code. Every array is
--     renumbered from 1 on entry; messages are numbered by position in errors, from 1.
--   * Headers that are JSON null ('null'::jsonb, psycopg's Jsonb(None), JSON.stringify(null)),
--     in txoutbox_enqueue, txoutbox_enqueue_many (an element of headers) and txoutbox_prepare,
--     are no headers, as SQL NULL and {} are; they were refused with TX003.
--   * txoutbox_cancel and txoutbox_reschedule of an id no message has raise TX202 (message not
--     found); TX201 stays for a message that is not scheduled, with DETAIL state=<its state>.
--     Their business key forms, when no message of the key is scheduled, look up the key's
--     latest message as CancelBizKeyTx does: none, TX202; else TX201 with DETAIL state=<its
--     state> (they raised TX201 for both).
--   * A traceparent header (name in any case) whose value is not a W3C trace context (lower-case
--     hex version-traceid-spanid-flags, ids not all zero, version not ff, version 00 exactly 55
--     characters; one value) is refused with TX003, as EnqueueTx refuses it
--     (outbox.ErrInvalidTraceparent): it was stored and published as given, and consumers'
--     propagators dropped it. New: txoutbox_traceparent_value_ok (inlined in the batch check,
--     which looks only at distinct headers whose text names a traceparent) and
--     txoutbox_traceparent_problem (what txoutbox_check_message says).
--   * A batch costs less: each distinct subject is checked, and each distinct headers object
--     sized, once; the prefix a batch's keys (and its ids) share is hashed once, and each
--     text's rest in the batch's statement (txoutbox_fnv, txoutbox_partition_keys); drawn ids
--     are written as hex text (txoutbox_uuidv7s). Partitions and ids do not change.
--     (The function settings plan_cache_mode and jit stay: they cost about 0.7 µs a call.)

-- Whether v is a W3C trace context traceparent value consumers' propagators accept
-- (outbox.ValidateTraceparent): version "-" trace-id "-" parent-id "-" trace-flags, 2, 32, 16
-- and 2 lower-case hex digits, the ids not all zero, the version not ff; version 00 exactly 55
-- characters, a later version 55 or more with a "-" after the flags. NULL for NULL.
CREATE FUNCTION txoutbox_traceparent_value_ok(v text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT v ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-|$)'
   AND left(v, 2) COLLATE "C" <> 'ff'
   AND substr(v, 4, 32) COLLATE "C" <> '00000000000000000000000000000000'
   AND substr(v, 37, 16) COLLATE "C" <> '0000000000000000'
   AND (left(v, 2) COLLATE "C" <> '00' OR octet_length(v) = 55)
$fn$;

-- What is wrong with the traceparent value v, in outbox.ValidateTraceparent's words and order,
-- or NULL when it is valid. ValidateTraceparent reads bytes: a character beyond ASCII is read
-- here as that many bytes, none of them a hex digit or '-'.
CREATE FUNCTION txoutbox_traceparent_problem(v text) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $fn$
DECLARE
    f record;
BEGIN
    IF v ~ '[^\u0001-\u007f]' THEN
        v := (SELECT string_agg(CASE WHEN octet_length(t.c) = 1 THEN t.c ELSE repeat('?', octet_length(t.c)) END, '' ORDER BY t.o)
              FROM regexp_split_to_table(v, '') WITH ORDINALITY AS t(c, o));
    END IF;
    IF octet_length(v) < 55 THEN
        RETURN format('is %s characters, a traceparent has at least 55 (version-traceid-spanid-flags)', octet_length(v));
    END IF;
    IF substr(v, 3, 1) <> '-' OR substr(v, 36, 1) <> '-' OR substr(v, 53, 1) <> '-' THEN
        RETURN 'is not version-traceid-spanid-flags (fields of 2, 32, 16 and 2 hex digits separated by -)';
    END IF;
    FOR f IN SELECT * FROM (VALUES (1, 'version', substr(v, 1, 2)), (2, 'trace id', substr(v, 4, 32)),
                                   (3, 'span id', substr(v, 37, 16)), (4, 'flags', substr(v, 54, 2))) AS x(ord, what, s)
             ORDER BY x.ord LOOP
        IF f.s !~ '^[0-9a-f]+$' THEN
            RETURN format('has a %s that is not lower-case hex', f.what);
        END IF;
    END LOOP;
    IF left(v, 2) = 'ff' THEN
        RETURN 'has version ff, which is invalid';
    END IF;
    IF substr(v, 4, 32) = '00000000000000000000000000000000' THEN
        RETURN 'has an all-zero trace id';
    END IF;
    IF substr(v, 37, 16) = '0000000000000000' THEN
        RETURN 'has an all-zero span id';
    END IF;
    IF left(v, 2) = '00' AND octet_length(v) <> 55 THEN
        RETURN format('is %s characters, a version 00 traceparent has exactly 55', octet_length(v));
    END IF;
    IF octet_length(v) > 55 AND substr(v, 56, 1) <> '-' THEN
        RETURN 'has more after the flags without a - between';
    END IF;
    IF NOT txoutbox_traceparent_value_ok(v) THEN
        RETURN 'is not version-traceid-spanid-flags (fields of 2, 32, 16 and 2 lower-case hex digits separated by -)';
    END IF;
    RETURN NULL;
END
$fn$;

-- txoutbox_check_message as migration 009's, which also says what is wrong with a traceparent
-- header (any case) that txoutbox_write's batch check refused, after
-- the other header checks and before the sizes, as EnqueueTx checks it.
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
        -- The traceparent (any case): one value, a W3C trace context (outbox.ErrInvalidTraceparent).
        SELECT count(*), min(e.key COLLATE "C"), min(v.value #>> '{}') INTO j, name, what
        FROM jsonb_each(headers) e
        CROSS JOIN LATERAL jsonb_array_elements(e.value) v(value)
        WHERE lower(e.key COLLATE "C") = 'traceparent';
        IF j > 1 THEN
            RAISE EXCEPTION USING ERRCODE = 'TX003',
                MESSAGE = format('%sheaders: invalid header: traceparent is not a W3C trace context: %s traceparent values: a message carries one trace context', ctx, j);
        END IF;
        IF j = 1 AND NOT txoutbox_traceparent_value_ok(what) THEN
            RAISE EXCEPTION USING ERRCODE = 'TX003',
                MESSAGE = format('%sheaders: invalid header: traceparent is not a W3C trace context: %s %s %s; the consumer''s propagator would drop it and the trace would end at the producer',
                                 ctx, to_jsonb(name), to_jsonb(CASE WHEN octet_length(what) > 80 THEN left(what, 80) || '…' ELSE what END),
                                 txoutbox_traceparent_problem(what));
        END IF;
        -- Not reached: txoutbox_write's batch check refuses nothing the checks above accept.
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

-- Checks and writes messages, as migration 009's txoutbox_write, with every array renumbered
-- from 1 and JSON null headers taken as none.
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
    -- Every array numbered from 1: the statements below pair unnest's positions with
    -- subscripts (subjects[bad], ids[first]), and a PL/pgSQL producer that fills s[i] from 0
    -- passes '[0:1]={...}'. (A slice renumbers; it is taken only when needed.)
    IF array_lower(subjects, 1) <> 1 THEN subjects := subjects[:]; END IF;
    IF array_lower(payloads, 1) <> 1 THEN payloads := payloads[:]; END IF;
    IF array_lower(keys, 1) <> 1 THEN keys := keys[:]; END IF;
    IF array_lower(headers, 1) <> 1 THEN headers := headers[:]; END IF;
    IF array_lower(biz_keys, 1) <> 1 THEN biz_keys := biz_keys[:]; END IF;
    IF array_lower(ids, 1) <> 1 THEN ids := ids[:]; END IF;
    IF array_lower(deliver_ats, 1) <> 1 THEN deliver_ats := deliver_ats[:]; END IF;
    -- Headers that are JSON null are none, as SQL NULL and {} are (psycopg's Jsonb(None),
    -- JSON.stringify(null)).
    IF 'null'::jsonb = ANY (headers) THEN
        headers := array_replace(headers, 'null'::jsonb, NULL);
    END IF;
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
                 m.subject_ok AND txoutbox_key_ok(m.k) AND txoutbox_key_ok(m.bk) AND m.hsize >= 0
                 AND txoutbox_header_block(m.hsize, m.k, m.bk) <= 61439
                 AND coalesce(octet_length(m.payload), 0) + txoutbox_header_block(m.hsize, m.k, m.bk) <= max_bytes
                 AND txoutbox_deliver_at_ok(m.d) AS ok
          FROM (SELECT u.ord, u.payload, nullif(u.key, '') AS k, nullif(u.biz_key, '') AS bk, u.d,
                       s.ok IS TRUE AS subject_ok, CASE WHEN u.hdr IS NULL THEN 0 ELSE h.hsize END AS hsize
                FROM unnest(subjects, payloads, keys, headers, biz_keys, ids, deliver_ats) WITH ORDINALITY
                     AS u(subject, payload, key, hdr, biz_key, id, d, ord)
                -- Each distinct subject checked once, and each distinct headers sized once (a
                -- batch's messages often share them: one traceparent for the call). Valid
                -- headers whose text names a traceparent (in any case: names are ASCII tokens,
                -- never escaped in jsonb's text) have it checked too; -1 when it is invalid.
                LEFT JOIN (SELECT x.subject, txoutbox_subject_ok(x.subject) AS ok
                           FROM (SELECT DISTINCT v.subject FROM unnest(subjects) AS v(subject) OFFSET 0) x) s
                       ON s.subject = u.subject
                LEFT JOIN (SELECT w.hdr,
                                  CASE WHEN w.hsize >= 0 AND w.hdr_text COLLATE "C" ILIKE '%"traceparent"%'
                                            AND NOT CASE
                                                -- "traceparent" and no other case of it: its one value.
                                                WHEN w.hdr ? 'traceparent' AND w.hdr_text COLLATE "C" NOT ILIKE '%"traceparent"%"traceparent"%'
                                                THEN jsonb_array_length(w.hdr -> 'traceparent') = 1
                                                     AND txoutbox_traceparent_value_ok(w.hdr -> 'traceparent' ->> 0)
                                                -- Else every header named traceparent in any case: one value in all.
                                                ELSE (SELECT count(*) <= 1 AND coalesce(bool_and(txoutbox_traceparent_value_ok(v.value #>> '{}')), true)
                                                      FROM jsonb_each(w.hdr) e
                                                      CROSS JOIN LATERAL jsonb_array_elements(e.value) v(value)
                                                      WHERE lower(e.key COLLATE "C") = 'traceparent') END
                                       THEN -1 ELSE w.hsize END AS hsize
                           FROM (SELECT y.hdr, y.hdr_text,
                                  -- The size of the headers' lines, -1 when they are invalid: from
                                  -- their text when it is simple, else header by header, value by value.
                                  CASE WHEN y.hdr_text IS NULL THEN -1
                                       ELSE coalesce(txoutbox_simple_headers_size(y.hdr_text), (
                                           SELECT CASE WHEN bool_and(txoutbox_header_name_ok(e.key) AND jsonb_typeof(e.value) = 'array'
                                                                     AND jsonb_array_length(e.value) > 0 AND txoutbox_header_value_ok(v.value)) IS NOT FALSE
                                                       THEN coalesce(sum(octet_length(e.key) + 4 + octet_length(v.value #>> '{}')), 0)::int
                                                       ELSE -1 END
                                           FROM jsonb_each(y.hdr) e
                                           LEFT JOIN LATERAL jsonb_array_elements(CASE WHEN jsonb_typeof(e.value) = 'array' THEN e.value END) v(value) ON true))
                                  END AS hsize
                           FROM (SELECT z.hdr, CASE WHEN jsonb_typeof(z.hdr) = 'object' THEN z.hdr::text END AS hdr_text
                                 FROM (SELECT DISTINCT v.hdr FROM unnest(headers) AS v(hdr) WHERE v.hdr IS NOT NULL) z
                                 OFFSET 0) y
                                 OFFSET 0) w) h
                       ON h.hdr = u.hdr
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

-- txoutbox_cancel and txoutbox_reschedule (by id) of a message that is not scheduled: TX202
-- when there is no such message (never enqueued, or published and deleted, or purged: as the
-- Go client's *ScheduleError then matches outbox.ErrNotFound), TX201 with DETAIL
-- state=<state> when it exists in another state.
CREATE OR REPLACE FUNCTION txoutbox_raise_not_scheduled(fn text, p_id uuid, st text) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $fn$
BEGIN
    IF st = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX202',
            MESSAGE = format('%s: id: message %s: message not found (never enqueued, or published and deleted, or purged)', fn, p_id);
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'TX201',
        MESSAGE = format('%s: id: message %s is %s: message is not scheduled', fn, p_id, st),
        DETAIL = format('state=%s', st);
END
$fn$;

-- txoutbox_cancel_biz_key and txoutbox_reschedule_biz_key as migration 009's, that tell, when
-- no message of the key is scheduled, what CancelBizKeyTx and RescheduleBizKeyTx tell: TX202
-- when no message has the key (never enqueued, or published and deleted, or purged: the Go
-- client's *ScheduleError then matches outbox.ErrNotFound too), else TX201 with DETAIL
-- state=<state> of the key's latest message (ready: it fell due and goes out). The lookup
-- reads the outbox's rows (the business key index covers only scheduled ones); it runs only
-- on a miss.
CREATE OR REPLACE FUNCTION txoutbox_cancel_biz_key(biz_key text) RETURNS uuid[]
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    ids uuid[];
    st text;
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
        -- None scheduled: the state of the key's latest message, as CancelBizKeyTx and
        -- RescheduleBizKeyTx read it (store's ScheduledBizKeyState).
        SELECT m.state INTO st FROM txoutbox_messages m
        WHERE (m.headers -> 'Txoutbox-Biz-Key' ->> 0) = txoutbox_cancel_biz_key.biz_key AND m.state <> 'scheduled'
        ORDER BY m.id DESC LIMIT 1;
        IF st IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'TX202',
                MESSAGE = format('txoutbox_cancel_biz_key: biz_key: no message has business key %L: message not found (never enqueued, or published and deleted, or purged)', biz_key);
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'TX201',
            MESSAGE = format('txoutbox_cancel_biz_key: biz_key: no message of business key %L is scheduled, the latest is %s: message is not scheduled', biz_key, st),
            DETAIL = format('state=%s', st);
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
    st text;
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
        -- None scheduled: the state of the key's latest message, as CancelBizKeyTx and
        -- RescheduleBizKeyTx read it (store's ScheduledBizKeyState).
        SELECT m.state INTO st FROM txoutbox_messages m
        WHERE (m.headers -> 'Txoutbox-Biz-Key' ->> 0) = txoutbox_reschedule_biz_key.biz_key AND m.state <> 'scheduled'
        ORDER BY m.id DESC LIMIT 1;
        IF st IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'TX202',
                MESSAGE = format('txoutbox_reschedule_biz_key: biz_key: no message has business key %L: message not found (never enqueued, or published and deleted, or purged)', biz_key);
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'TX201',
            MESSAGE = format('txoutbox_reschedule_biz_key: biz_key: no message of business key %L is scheduled, the latest is %s: message is not scheduled', biz_key, st),
            DETAIL = format('state=%s', st);
    END IF;
    RETURN ids;
END
$fn$;

-- FNV-1a (32 bits) of the bytes b continued from the state h (2166136261 to start), unmasked:
-- txoutbox_key_hash and store.KeyHash are txoutbox_fnv(2166136261, the key's UTF-8 bytes) &
-- 2147483647. Eight bytes a statement, then the last 0 to 7 in one (as migration 007's
-- txoutbox_partition_keys hashed). NULL for NULL.
CREATE FUNCTION txoutbox_fnv(h bigint, b bytea) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
DECLARE
    j int := 0;
BEGIN
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
    RETURN h;
END
$fn$;

-- The partition keys of a batch, as migration 007's (FNV-1a of each key's UTF-8 bytes, or of
-- the message id's text for a message without a key, masked to 31 bits), each key paired with
-- its id by position (007 paired keys[i] with ids[i], so that keys numbered from another index
-- than the ids took another message's hash). The texts of a batch share a prefix, most often:
-- ids drawn by one txoutbox_uuidv7s call share their first 30 or so characters, and keys are
-- often of one pattern (order-1041, order-1042). The longest prefix the keys share, and the
-- one the ids share, is hashed once (txoutbox_fnv), and each text's remaining 0 to 7 bytes in
-- one expression of the batch's statement; a text with more left is hashed on from the
-- prefix's state by txoutbox_fnv. (Byte by byte in PL/pgSQL, an id's 36 characters cost about
-- 2.8 µs a message.)
CREATE OR REPLACE FUNCTION txoutbox_partition_keys(keys text[], ids uuid[]) RETURNS int4[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $fn$
DECLARE
    kmin bytea;
    kmax bytea;
    imin bytea;
    imax bytea;
    kp int := 0;
    ip int := 0;
    lo int;
    hi int;
    mid int;
    kh bigint; -- the FNV state after the keys' prefix
    ih bigint; -- after the ids'
BEGIN
    -- The longest common prefix of a group's texts is that of its least and greatest, in byte
    -- order (COLLATE "C" compares UTF-8 bytes; uuids compare as their text does): found by
    -- halving.
    SELECT convert_to(min(u.k COLLATE "C") FILTER (WHERE u.k <> ''), 'UTF8'), convert_to(max(u.k COLLATE "C") FILTER (WHERE u.k <> ''), 'UTF8'),
           convert_to(min(u.id::text COLLATE "C") FILTER (WHERE u.k = '' OR u.k IS NULL), 'UTF8'), convert_to(max(u.id::text COLLATE "C") FILTER (WHERE u.k = '' OR u.k IS NULL), 'UTF8')
      INTO kmin, kmax, imin, imax
    FROM unnest(keys, ids) WITH ORDINALITY AS u(k, id, ord)
    WHERE u.ord <= cardinality(ids);
    lo := 0;
    hi := coalesce(least(length(kmin), length(kmax)), 0);
    WHILE lo < hi LOOP
        mid := (lo + hi + 1) / 2;
        IF substring(kmin FROM 1 FOR mid) = substring(kmax FROM 1 FOR mid) THEN lo := mid; ELSE hi := mid - 1; END IF;
    END LOOP;
    kp := lo;
    lo := 0;
    hi := coalesce(least(length(imin), length(imax)), 0);
    WHILE lo < hi LOOP
        mid := (lo + hi + 1) / 2;
        IF substring(imin FROM 1 FOR mid) = substring(imax FROM 1 FOR mid) THEN lo := mid; ELSE hi := mid - 1; END IF;
    END LOOP;
    ip := lo;
    kh := txoutbox_fnv(2166136261, substring(kmin FROM 1 FOR kp));
    ih := txoutbox_fnv(2166136261, substring(imin FROM 1 FOR ip));
    RETURN ARRAY(
        SELECT ((CASE length(t.b) - t.p
                      WHEN 0 THEN t.h
                          WHEN 1 THEN ((t.h # get_byte(t.b, t.p)) * 16777619 & 4294967295)
                          WHEN 2 THEN ((((t.h # get_byte(t.b, t.p)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 1)) * 16777619 & 4294967295)
                          WHEN 3 THEN ((((((t.h # get_byte(t.b, t.p)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 1)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 2)) * 16777619 & 4294967295)
                          WHEN 4 THEN ((((((((t.h # get_byte(t.b, t.p)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 1)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 2)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 3)) * 16777619 & 4294967295)
                          WHEN 5 THEN ((((((((((t.h # get_byte(t.b, t.p)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 1)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 2)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 3)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 4)) * 16777619 & 4294967295)
                          WHEN 6 THEN ((((((((((((t.h # get_byte(t.b, t.p)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 1)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 2)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 3)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 4)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 5)) * 16777619 & 4294967295)
                          WHEN 7 THEN ((((((((((((((t.h # get_byte(t.b, t.p)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 1)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 2)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 3)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 4)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 5)) * 16777619 & 4294967295) # get_byte(t.b, t.p + 6)) * 16777619 & 4294967295)
                      ELSE txoutbox_fnv(t.h, substring(t.b FROM t.p + 1)) END) & 2147483647)::int4
        FROM (SELECT u.ord, u.b, CASE WHEN u.keyed THEN kp ELSE ip END AS p,
                     CASE WHEN u.keyed THEN kh ELSE ih END AS h
              FROM (SELECT v.ord, v.k <> '' IS TRUE AS keyed, convert_to(coalesce(nullif(v.k, ''), v.id::text), 'UTF8') AS b
                    FROM unnest(keys, ids) WITH ORDINALITY AS v(k, id, ord)
                    WHERE v.ord <= cardinality(ids)) u
              OFFSET 0) t
        ORDER BY t.ord);
END
$fn$;

-- EXECUTE on txoutbox_fnv, which txoutbox_partition_keys calls with the caller's privileges,
-- not to PUBLIC (004), goes to whoever may execute txoutbox_partition_keys: its grantees (the
-- producer roles granted before this migration) and its owner (the owner of the earlier
-- migrations' functions, when another role runs this one), so that they keep enqueueing.
REVOKE EXECUTE ON FUNCTION txoutbox_fnv(bigint, bytea) FROM PUBLIC;
DO $do$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT g.grantee FROM pg_proc o
             CROSS JOIN LATERAL (SELECT a.grantee FROM aclexplode(o.proacl) a WHERE a.privilege_type = 'EXECUTE'
                                 UNION ALL SELECT o.proowner) g
             WHERE o.oid = 'txoutbox_partition_keys(text[], uuid[])'::regprocedure
               AND g.grantee <> (SELECT f.proowner FROM pg_proc f WHERE f.oid = 'txoutbox_fnv(bigint, bytea)'::regprocedure) LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION txoutbox_fnv(bigint, bytea) TO %s',
                       CASE WHEN r.grantee = 0 THEN 'PUBLIC' ELSE r.grantee::regrole::text END);
    END LOOP;
END
$do$;

-- txoutbox_uuidv7s as migration 008's (the same ids: RFC 9562 monotonic random UUIDv7s of one
-- random draw), each written as 32 hex digits from the call's first 16 and its own last 16,
-- instead of encoding 16 bytes per id and sorting them.
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
    -- The first 16 hex digits, the same for the whole call.
    p text := lpad(to_hex(hi), 16, '0');
BEGIN
    -- lo + g keeps its top bit (var): to_hex writes its 16 digits. generate_series yields g in
    -- order, and so does the array.
    RETURN ARRAY(SELECT (p || to_hex(lo + g))::uuid FROM generate_series(1, n) g);
END
$fn$;

-- EXECUTE on the traceparent checks, which txoutbox_write and txoutbox_check_message call with
-- the caller's privileges, not to PUBLIC (004), goes to whoever may execute txoutbox_write: its
-- grantees (the producer roles granted before this migration) and its owner (the owner of the
-- earlier migrations' functions, when another role runs this one), so that they keep enqueueing.
REVOKE EXECUTE ON FUNCTION txoutbox_traceparent_value_ok(text), txoutbox_traceparent_problem(text) FROM PUBLIC;
DO $do$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT g.grantee, f.oid::regprocedure AS fn FROM pg_proc o
             CROSS JOIN LATERAL (SELECT a.grantee FROM aclexplode(o.proacl) a WHERE a.privilege_type = 'EXECUTE'
                                 UNION ALL SELECT o.proowner) g
             CROSS JOIN pg_proc f
             WHERE o.oid = 'txoutbox_write(text, boolean, text[], bytea[], text[], jsonb[], text[], uuid[], timestamptz[], text, text, interval)'::regprocedure
               AND f.oid IN ('txoutbox_traceparent_value_ok(text)'::regprocedure,
                             'txoutbox_traceparent_problem(text)'::regprocedure)
               AND g.grantee <> f.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', r.fn,
                       CASE WHEN r.grantee = 0 THEN 'PUBLIC' ELSE r.grantee::regrole::text END);
    END LOOP;
END
$do$;
