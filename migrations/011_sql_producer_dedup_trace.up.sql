-- txoutbox 011: the SQL producer functions refuse, as EnqueueTx now does, what would cost a
-- message its deduplication or its trace.
--   * The text Nats-Msg-Id, in that case, anywhere in a key or business key (TX002), a header
--     name or a header value (TX003; outbox.HeaderMsgID): nats-server finds a message's id by
--     searching its raw header block for that text, and the relay's Txoutbox-Key,
--     Txoutbox-Biz-Key and the message's own headers go into the block in map order, some
--     before its Nats-Msg-Id. nats-server 2.9 looks only at the first occurrence, and 2.15
--     misses the header when the text occurs twice close together: such a message was stored
--     without its id, and a republish of it stored again instead of dropped by the stream's
--     duplicate window. The business key forms of cancel and reschedule refuse such a key as
--     CancelBizKeyTx does (TX002). New: txoutbox_holds_msg_id_text; the batch check looks for
--     the text once in each distinct headers object's JSON text (txoutbox_simple_headers_size)
--     and checks such headers one by one.
--   * A version-00 traceparent whose flags are above 03 (TX003, "traceparent is not a W3C trace
--     context"; outbox.ValidateTraceparent): version 00 defines only the sampled (01) and
--     random (02) bits, and OpenTelemetry's propagator (go.opentelemetry.io/otel 1.47,
--     TraceContext.extract) drops such a traceparent, so the trace ended at the producer.
--     txoutbox_traceparent_value_ok (inlined in the batch check) and
--     txoutbox_traceparent_problem as 010's, with that rule.

-- Whether s holds the text nats-server searches a message's header block for to find its
-- Nats-Msg-Id, in that case (outbox.HeaderMsgID): no key, business key, header name or header
-- value may. NULL for NULL.
CREATE FUNCTION txoutbox_holds_msg_id_text(s text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT strpos(s COLLATE "C", 'Nats-Msg-Id') > 0
$fn$;

-- Whether s is a valid key or business key, as in 004, and does not hold the text Nats-Msg-Id.
CREATE OR REPLACE FUNCTION txoutbox_key_ok(s text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT s IS NULL OR (octet_length(s) <= 1024
    AND s !~ ('^[' || txoutbox_space_chars() || ']|[' || txoutbox_space_chars() || ']$|[' || txoutbox_control_chars(false) || ']')
    AND NOT txoutbox_holds_msg_id_text(s))
$fn$;

-- Whether name is a header name a producer may set, as in 004, and does not hold the text
-- Nats-Msg-Id ("X-Orig-Nats-Msg-Id"; the name Nats-Msg-Id itself is reserved, in any case).
CREATE OR REPLACE FUNCTION txoutbox_header_name_ok(name text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT name ~ '^[A-Za-z0-9!#$%&''*+.^_`|~-]+$'
   AND lower(name COLLATE "C") NOT LIKE 'nats-%' AND lower(name COLLATE "C") NOT LIKE 'txoutbox-%'
   AND lower(name COLLATE "C") NOT IN ('status', 'description')
   AND NOT txoutbox_holds_msg_id_text(name)
$fn$;

-- Whether value is a valid header value, as in 004, and does not hold the text Nats-Msg-Id.
CREATE OR REPLACE FUNCTION txoutbox_header_value_ok(value jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT jsonb_typeof(value) = 'string'
   AND (value #>> '{}') !~ ('^[' || txoutbox_space_chars() || ']|[' || txoutbox_space_chars() || ']$|[' || txoutbox_control_chars(true) || ']')
   AND NOT txoutbox_holds_msg_id_text(value #>> '{}')
$fn$;

-- What is wrong with s as a key or a header value, as in 004, and last the text Nats-Msg-Id
-- (outbox's checkText, in its order and words).
CREATE OR REPLACE FUNCTION txoutbox_text_problem(s text, tab_inside boolean) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $fn$
BEGIN
    IF s ~ ('^[' || txoutbox_space_chars() || ']') THEN
        RETURN format('begins with white space (U+%s): trim it (NATS drops white space at the ends of a header value, and values that differ only there look alike)',
                      upper(lpad(to_hex(ascii(left(s, 1))), 4, '0')));
    END IF;
    IF s ~ ('[' || txoutbox_space_chars() || ']$') THEN
        RETURN format('ends with white space (U+%s): trim it (NATS drops white space at the ends of a header value, and values that differ only there look alike)',
                      upper(lpad(to_hex(ascii(right(s, 1))), 4, '0')));
    END IF;
    IF s ~ ('[' || txoutbox_control_chars(tab_inside) || ']') THEN
        RETURN CASE WHEN tab_inside THEN 'holds a control character (C0 other than a tab inside it, DEL or C1)'
                    ELSE 'holds a control character (C0, DEL or C1)' END;
    END IF;
    IF txoutbox_holds_msg_id_text(s) THEN
        RETURN 'holds the text "Nats-Msg-Id": nats-server would mistake it for the Nats-Msg-Id header (it finds the message id by searching the header block for that text) and store the message without deduplication';
    END IF;
    RETURN NULL;
END
$fn$;

-- The size of the lines of simple headers, as in 007, and NULL for headers whose JSON text
-- holds Nats-Msg-Id: they are checked one by one (txoutbox_header_name_ok and
-- txoutbox_header_value_ok refuse them). jsonb's text never escapes a letter or '-', and the
-- text is made of no other character, so it is in the JSON text exactly when a name or a value
-- holds it. One strpos for each distinct headers object of a batch.
CREATE OR REPLACE FUNCTION txoutbox_simple_headers_size(t text) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT CASE WHEN t = '{}' THEN 0
            WHEN txoutbox_holds_msg_id_text(t) THEN NULL
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

-- txoutbox_check_message as migration 010's, which also says so of a header name that holds
-- the text Nats-Msg-Id, after the reserved names (as outbox's validateHeaders); keys and values
-- that hold it are told by txoutbox_text_problem.
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
            IF txoutbox_holds_msg_id_text(name) THEN
                RAISE EXCEPTION USING ERRCODE = 'TX003',
                    MESSAGE = format('%sheaders: invalid header: name %s %s', ctx, to_jsonb(name),
                                     'holds the text "Nats-Msg-Id": nats-server would mistake it for the Nats-Msg-Id header (it finds the message id by searching the header block for that text) and store the message without deduplication');
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

-- Whether v is a traceparent value consumers' propagators accept, as in 010, a version 00 one
-- only with flags 00 to 03 (OpenTelemetry's drops one with another bit set).
CREATE OR REPLACE FUNCTION txoutbox_traceparent_value_ok(v text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT v ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-|$)'
   AND left(v, 2) COLLATE "C" <> 'ff'
   AND substr(v, 4, 32) COLLATE "C" <> '00000000000000000000000000000000'
   AND substr(v, 37, 16) COLLATE "C" <> '0000000000000000'
   AND (left(v, 2) COLLATE "C" <> '00' OR (octet_length(v) = 55 AND substr(v, 54, 2) COLLATE "C" <= '03'))
$fn$;

-- What is wrong with the traceparent value v, as in 010, and a version 00 one's flags above 03
-- (outbox.ValidateTraceparent's words and order).
CREATE OR REPLACE FUNCTION txoutbox_traceparent_problem(v text) RETURNS text
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
    IF left(v, 2) = '00' AND substr(v, 54, 2) COLLATE "C" > '03' THEN
        RETURN format('has version 00 and flags %s: version 00 defines only the sampled (01) and random (02) bits, and propagators drop a version 00 traceparent with another bit set', substr(v, 54, 2));
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

-- EXECUTE on txoutbox_holds_msg_id_text, not to PUBLIC (004), goes to whoever may execute the
-- functions that call it with the caller's privileges: their grantees (the producer roles
-- granted before this migration) and their owner (the owner of the earlier migrations'
-- functions, when another role runs this one), so that they keep enqueueing.
REVOKE EXECUTE ON FUNCTION txoutbox_holds_msg_id_text(text) FROM PUBLIC;
DO $do$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT g.grantee FROM pg_proc o
             CROSS JOIN LATERAL (SELECT a.grantee FROM aclexplode(o.proacl) a WHERE a.privilege_type = 'EXECUTE'
                                 UNION ALL SELECT o.proowner) g
             WHERE o.oid IN ('txoutbox_key_ok(text)'::regprocedure, 'txoutbox_header_name_ok(text)'::regprocedure,
                             'txoutbox_header_value_ok(jsonb)'::regprocedure, 'txoutbox_text_problem(text, boolean)'::regprocedure,
                             'txoutbox_simple_headers_size(text)'::regprocedure,
                             'txoutbox_check_message(text, text, bytea, text, jsonb, text, int)'::regprocedure)
               AND g.grantee <> (SELECT f.proowner FROM pg_proc f WHERE f.oid = 'txoutbox_holds_msg_id_text(text)'::regprocedure) LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION txoutbox_holds_msg_id_text(text) TO %s',
                       CASE WHEN r.grantee = 0 THEN 'PUBLIC' ELSE r.grantee::regrole::text END);
    END LOOP;
END
$do$;
