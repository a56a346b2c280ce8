-- txoutbox 004: the SQL contract for producers in any language or database layer.
-- Functions any driver calls inside its own transaction, with the rules of the Go client
-- (outbox.EnqueueTx, Prepare, Commit, CommitTx, Rollback): the same validation, the same
-- per-key advisory locks before the row id is drawn, UUIDv7 ids, the same half-message states.
-- Errors carry SQLSTATE codes of class TX (README, "The SQL contract"):
--   TX001 invalid subject        TX002 invalid key (key, biz_key)   TX003 invalid header
--   TX004 header block too large TX005 message too large            TX006 duplicate message id
--   TX007 invalid producer group TX008 invalid argument (batch arrays of unequal length)
--   TX101 half message rolled back  TX102 already committed  TX103 not found
-- The public functions run with the search_path of this migration (SET search_path FROM
-- CURRENT), so callers need not set one; they are SECURITY INVOKER: the caller needs the
-- producer role's table privileges (relay migrate grants --role producer) and EXECUTE.

-- FNV-1a (32 bits) of s's UTF-8 bytes, masked to 31 bits: store.KeyHash. It is the key's
-- advisory lock, partition_key, and (with its prefix) the lock classes below.
CREATE FUNCTION txoutbox_key_hash(s text) RETURNS int4
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
DECLARE
    b bytea := convert_to(s, 'UTF8');
    h bigint := 2166136261;
BEGIN
    FOR i IN 0 .. length(b) - 1 LOOP
        h := ((h # get_byte(b, i)) * 16777619) & 4294967295;
    END LOOP;
    RETURN (h & 2147483647)::int4;
END
$fn$;

-- The advisory lock classes of this schema (store.Queries.KeyLockClass, KeyBucketLockClass),
-- computed from the name of the schema the migration runs in.
DO $do$
BEGIN
    EXECUTE format('CREATE FUNCTION txoutbox_lock_classes(OUT key_class int4, OUT bucket_class int4) '
                   'LANGUAGE sql IMMUTABLE PARALLEL SAFE AS %L',
                   format('SELECT %s::int4, %s::int4',
                          txoutbox_key_hash('txoutbox.key:' || current_schema()),
                          txoutbox_key_hash('txoutbox.keybucket:' || current_schema())));
END
$do$;

-- Locks key hashes as store's keylock.go does, in one statement (its keyLockSQL), with this
-- schema's lock classes: within the transaction's budget of 256 exact key locks (counted in
-- the setting txoutbox.key_locks, shared with the Go client), a shared lock on each bucket
-- (hash % 256) then an exclusive lock on each key hash, all sorted; past it, an exclusive
-- lock on each bucket.
DO $do$
DECLARE
    kc int4;
    bc int4;
BEGIN
    SELECT key_class, bucket_class INTO kc, bc FROM txoutbox_lock_classes();
    EXECUTE format($f$CREATE FUNCTION txoutbox_lock_key_hashes(hashes int4[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $b$
DECLARE
    n bigint;
    h int4;
    done text;
BEGIN
    IF cardinality(hashes) = 1 AND hashes[1] IS NOT NULL THEN
        -- One key (txoutbox_enqueue, txoutbox_commit): the same locks, in simple expressions.
        h := hashes[1];
        n := coalesce(nullif(current_setting('txoutbox.key_locks', true), ''), '0')::int4;
        IF n + 1 <= 256 THEN
            done := set_config('txoutbox.key_locks', (n + 1)::text, true);
            done := pg_advisory_xact_lock_shared(%2$s::int4, h %% 256)::text;
            done := pg_advisory_xact_lock(%1$s::int4, h)::text;
        ELSE
            done := pg_advisory_xact_lock(%2$s::int4, h %% 256)::text;
        END IF;
        RETURN;
    END IF;
    WITH c AS MATERIALIZED (
        SELECT x.n + cardinality(x.k) <= 256 AS exact, x.k, x.b,
               set_config('txoutbox.key_locks',
                 (x.n + CASE WHEN x.n + cardinality(x.k) <= 256 THEN cardinality(x.k) ELSE 0 END)::text, true) AS n
        FROM (SELECT coalesce(nullif(current_setting('txoutbox.key_locks', true), ''), '0')::int4 AS n, s.k,
                     ARRAY(SELECT DISTINCT y %% 256 FROM unnest(s.k) y ORDER BY 1) AS b
              FROM (SELECT ARRAY(SELECT DISTINCT y FROM unnest(hashes) y WHERE y IS NOT NULL ORDER BY 1) AS k) s
              WHERE cardinality(s.k) > 0
              OFFSET 0) x
    )
    SELECT count(CASE WHEN u.i > cardinality(c.b) THEN pg_advisory_xact_lock(%1$s::int4, u.v)
                      WHEN c.exact THEN pg_advisory_xact_lock_shared(%2$s::int4, u.v)
                      ELSE pg_advisory_xact_lock(%2$s::int4, u.v) END) INTO n
    FROM c CROSS JOIN LATERAL unnest(CASE WHEN c.exact THEN c.b || c.k ELSE c.b END) WITH ORDINALITY AS u(v, i);
END
$b$$f$, kc, bc);
END
$do$;

-- A version 7 UUID (RFC 9562): 48 bits of Unix milliseconds, then random bits.
CREATE FUNCTION txoutbox_uuidv7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $fn$
SELECT encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid())
    PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
    FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid
$fn$;

-- The rules, as inlinable predicates (LANGUAGE sql, one expression: the planner folds them
-- into the statement that checks a whole batch at once, without a function call per
-- message). txoutbox_check_message says, for a message they refuse, what is wrong.

-- The white space a key or header value must not begin or end with, as a bracket
-- expression's content: Unicode White_Space and the zero-width characters U+200B-U+200D,
-- U+2060, U+FEFF (outbox's checkText).
CREATE FUNCTION txoutbox_space_chars() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT '\u0009-\u000d\u0020\u0085\u00a0\u1680\u2000-\u200d\u2028\u2029\u202f\u205f\u2060\u3000\ufeff'::text
$fn$;

-- The control characters a key (tab_inside false) or header value (tab_inside true) must not
-- hold, as a bracket expression's content: C0 (but a tab inside a header value), DEL, C1.
CREATE FUNCTION txoutbox_control_chars(tab_inside boolean) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT CASE WHEN tab_inside THEN '\u0001-\u0008\u000a-\u001f\u007f-\u009f' ELSE '\u0001-\u001f\u007f-\u009f' END
$fn$;

-- Whether s is a valid subject (outbox.ValidateSubject): 1 to 1024 bytes, no white space or
-- control character (C0, DEL, C1), no empty or wildcard token, not under $JS, $JSC, $SYS, $NRG.
-- NULL for NULL.
CREATE FUNCTION txoutbox_subject_ok(s text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT octet_length(s) BETWEEN 1 AND 1024
   AND s !~ '[\u0001-\u0020\u007f-\u009f]|(^|\.)(\.|$)|(^|\.)[*>](\.|$)'
   AND split_part(s, '.', 1) NOT IN ('$JS', '$JSC', '$SYS', '$NRG')
$fn$;

-- Whether s is a valid key or business key (outbox.ValidateKey; NULL is none, valid): at most
-- 1024 bytes, neither beginning nor ending with white space, without control characters.
CREATE FUNCTION txoutbox_key_ok(s text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT s IS NULL OR (octet_length(s) <= 1024
    AND s !~ ('^[' || txoutbox_space_chars() || ']|[' || txoutbox_space_chars() || ']$|[' || txoutbox_control_chars(false) || ']'))
$fn$;

-- Whether name is a header name a producer may set (outbox.ValidateHeaderName): an RFC 7230
-- token, not Nats-*, Txoutbox-*, Status or Description (in any case).
CREATE FUNCTION txoutbox_header_name_ok(name text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT name ~ '^[A-Za-z0-9!#$%&''*+.^_`|~-]+$'
   AND lower(name COLLATE "C") NOT LIKE 'nats-%' AND lower(name COLLATE "C") NOT LIKE 'txoutbox-%'
   AND lower(name COLLATE "C") NOT IN ('status', 'description')
$fn$;

-- Whether value (a JSON value of a header's array) is a valid header value
-- (outbox.ValidateHeaderValue): a string neither beginning nor ending with white space,
-- without control characters but tabs inside.
CREATE FUNCTION txoutbox_header_value_ok(value jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT jsonb_typeof(value) = 'string'
   AND (value #>> '{}') !~ ('^[' || txoutbox_space_chars() || ']|[' || txoutbox_space_chars() || ']$|[' || txoutbox_control_chars(true) || ']')
$fn$;

-- One header of simple headers' JSON text, as a regular expression: "name": ["value"], the
-- name a token, the value without '"', '\' (JSON's escapes) or control characters, neither
-- beginning nor ending with white space.
CREATE FUNCTION txoutbox_simple_header_re() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT '"[A-Za-z0-9!#$%&''*+.^_`|~-]+": \["([^"\\' || txoutbox_space_chars() || txoutbox_control_chars(false)
    || ']([^"\\' || txoutbox_control_chars(false) || ']*[^"\\' || txoutbox_space_chars() || txoutbox_control_chars(false)
    || '])?)?"\]'
$fn$;

-- The size of the lines of headers whose JSON text (jsonb's output) is t, when that text is
-- simple: every header with exactly one value, as txoutbox_simple_header_re matches it, and
-- not reserved. Else NULL, and the headers are checked and sized one by one. Reading the
-- text is much cheaper than expanding the JSON: t is {"n1": ["v1"], "n2": ["v2"], ...}, with
-- names and values as they are, so with N headers its length is
-- 10 N + sum(octet_length(name)) + sum(octet_length(value)), and the lines' size,
-- sum(octet_length(name) + 4 + octet_length(value)), is octet_length(t) - 6 N, N being the
-- number of '"' over 4.
CREATE FUNCTION txoutbox_simple_headers_size(t text) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT CASE WHEN t = '{}' THEN 0
            WHEN t ~ ('^\{' || txoutbox_simple_header_re() || '(, ' || txoutbox_simple_header_re() || ')*\}$')
             AND t !~* '"(nats-[^"]*|txoutbox-[^"]*|status|description)": \['
            THEN octet_length(t) - 6 * ((octet_length(t) - octet_length(replace(t, '"', ''))) / 4)
       END
$fn$;

-- The header block NATS stores for a message whose headers (valid) add hsize bytes of lines,
-- as outbox.HeaderBlockSize counts it: "NATS/1.0\r\n", the lines, the relay's Nats-Msg-Id (a
-- 36-character UUID), Txoutbox-Key, Txoutbox-Biz-Key, and "\r\n". Each header value costs
-- "Name: value\r\n" (octet_length(name) + 4 + octet_length(value)).
CREATE FUNCTION txoutbox_header_block(hsize int, key text, biz_key text) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT 12 + hsize + 51
    + CASE WHEN key IS NULL THEN 0 ELSE 16 + octet_length(key) END
    + CASE WHEN biz_key IS NULL THEN 0 ELSE 20 + octet_length(biz_key) END
$fn$;

-- The headers column of a valid message: the caller's headers plus Txoutbox-Biz-Key, NULL for
-- none. (STABLE as jsonb_build_object is, so that it inlines.)
CREATE FUNCTION txoutbox_stored_headers(headers jsonb, biz_key text) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE AS $fn$
SELECT CASE WHEN biz_key IS NOT NULL
            THEN coalesce(headers, '{}'::jsonb) || jsonb_build_object('Txoutbox-Biz-Key', jsonb_build_array(biz_key))
            WHEN headers = '{}'::jsonb THEN NULL
            ELSE headers END
$fn$;

-- What is wrong with s as a key (tab_inside false) or a header value (tab_inside true), or
-- NULL: outbox's checkText, in words. Text is valid UTF-8 without NUL in a UTF8 database.
CREATE FUNCTION txoutbox_text_problem(s text, tab_inside boolean) RETURNS text
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
    RETURN NULL;
END
$fn$;

-- Raises the error of the first problem of a message the predicates above refused, as
-- outbox.EnqueueTx reports it (in its order: subject, key, biz_key, headers, header block
-- size, message size), with SQLSTATE TX001-TX005; ctx prefixes the messages. hsize is the
-- size of the headers' lines, -1 when they are invalid (computed with the rest of the batch by
-- txoutbox_write). Returns when it finds nothing wrong.
CREATE FUNCTION txoutbox_check_message(ctx text, subject text, payload bytea, key text, headers jsonb, biz_key text,
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
    -- message at most outbox.DefaultMaxMessageBytes (1048576).
    block := txoutbox_header_block(coalesce(hsize, 0), key, biz_key);
    IF block > 61439 THEN
        RAISE EXCEPTION USING ERRCODE = 'TX004',
            MESSAGE = format('%sheaders: header block too large: the header block NATS stores (the headers, the relay''s Nats-Msg-Id, Txoutbox-Key and Txoutbox-Biz-Key, and framing) is %s bytes, the limit is 61439 bytes (nats-server stores at most 65535 whatever the payload, and a consumer''s dead letter of the message adds up to 4096)', ctx, block);
    END IF;
    total := coalesce(octet_length(payload), 0)::bigint + block;
    IF total > 1048576 THEN
        RAISE EXCEPTION USING ERRCODE = 'TX005',
            MESSAGE = format('%spayload: message too large: payload %s bytes + headers = %s bytes, over the limit of 1048576 bytes (NATS counts headers, including the relay''s)',
                             ctx, coalesce(octet_length(payload), 0), total);
    END IF;
END
$fn$;

-- Checks and writes messages in the caller's transaction, in array order: txoutbox_enqueue,
-- _enqueue_many and _prepare are this function (fn names the caller in errors; numbered: its
-- errors name the message's position). The arrays are one-dimensional, of equal length
-- (subjects' elements; keys, headers, biz_keys and ids may be NULL), keys and biz_keys '' for
-- none.
--
-- One statement checks every message with the predicates above, draws the missing ids and
-- hashes the partition keys; another finds a caller's id repeated in the call. The first
-- message refused (in array order) raises its error: txoutbox_check_message says what is
-- wrong, else its id repeats an earlier one's. Nothing is written unless every message is
-- valid. check_mode NULL writes ready messages, after locking their keys
-- (txoutbox_lock_key_hashes, before the row ids are drawn); 'checker' or 'fence' writes
-- prepared ones (no key lock) with producer_group and a first check-back after
-- check_immunity. Returns the message ids in order.
--
-- Its statements are planned once per session (plan_cache_mode = force_generic_plan): planned
-- for the arrays of each call, the checking statement, which inlines the predicates, would
-- cost more than it saves. jit is off: the planner's row estimates for unnest and the jsonb
-- functions are far above a batch's real size, and compiling would cost more than the
-- statement.
CREATE FUNCTION txoutbox_write(fn text, numbered boolean, subjects text[], payloads bytea[], keys text[],
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
    lock_hashes int4[];
    done uuid[];
    ctx text;
BEGIN
    SELECT min(c.ord) FILTER (WHERE c.ok IS NOT TRUE), array_agg(c.hsize ORDER BY c.ord),
           array_agg(c.mid ORDER BY c.ord), array_agg(c.part ORDER BY c.ord),
           array_agg(c.part) FILTER (WHERE c.k IS NOT NULL)
      INTO bad, hsizes, out_ids, out_parts, lock_hashes
    FROM (SELECT m.ord, m.k, m.mid, m.hsize, m.part,
                 txoutbox_subject_ok(m.subject) AND txoutbox_key_ok(m.k) AND txoutbox_key_ok(m.bk) AND m.hsize >= 0
                 AND txoutbox_header_block(m.hsize, m.k, m.bk) <= 61439
                 AND coalesce(octet_length(m.payload), 0) + txoutbox_header_block(m.hsize, m.k, m.bk) <= 1048576 AS ok
          FROM (SELECT t.*, txoutbox_key_hash(coalesce(t.k, t.mid::text)) AS part,
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
    IF check_mode IS NULL AND lock_hashes IS NOT NULL THEN
        PERFORM txoutbox_lock_key_hashes(lock_hashes);
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

-- Enqueues many messages in the caller's transaction, in array order (as outbox.EnqueueTx
-- does): subjects and payloads are required, the other arrays optional (NULL, or one element
-- per subject, NULL or '' for none). Nothing is written unless every message is valid. It
-- locks the messages' keys (txoutbox_lock_key_hashes) before the row ids are drawn, and
-- returns the message ids in order.
CREATE FUNCTION txoutbox_enqueue_many(subjects text[], payloads bytea[], keys text[] DEFAULT NULL,
    headers jsonb[] DEFAULT NULL, biz_keys text[] DEFAULT NULL, ids uuid[] DEFAULT NULL)
RETURNS uuid[]
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    n int := coalesce(cardinality(subjects), 0);
BEGIN
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
END
$fn$;

-- Enqueues one message in the caller's transaction: txoutbox_enqueue_many of one.
CREATE FUNCTION txoutbox_enqueue(subject text, payload bytea, key text DEFAULT NULL, headers jsonb DEFAULT NULL,
    biz_key text DEFAULT NULL, id uuid DEFAULT NULL)
RETURNS uuid
LANGUAGE sql VOLATILE
SET search_path FROM CURRENT
AS $fn$
SELECT (txoutbox_write('txoutbox_enqueue', false, ARRAY[subject], ARRAY[payload], ARRAY[key], ARRAY[headers],
                       ARRAY[biz_key], ARRAY[id], NULL, NULL, NULL))[1]
$fn$;

-- Half messages (outbox.Prepare): validated as txoutbox_enqueue, stored prepared (invisible to
-- the relay) without a key lock. producer_group is required unless fence is true (1 to 128
-- letters, digits, '-' and '_'); check_immunity delays the first check-back. Call it in a
-- transaction of its own (autocommit), so that the message is stored before the work starts.
CREATE FUNCTION txoutbox_prepare(subject text, payload bytea, key text DEFAULT NULL, headers jsonb DEFAULT NULL,
    biz_key text DEFAULT NULL, id uuid DEFAULT NULL, producer_group text DEFAULT NULL, fence boolean DEFAULT false,
    check_immunity interval DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    g text := nullif(producer_group, '');
BEGIN
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
                           ARRAY[biz_key], ARRAY[id], g, CASE WHEN coalesce(fence, false) THEN 'fence' ELSE 'checker' END,
                           check_immunity))[1];
END
$fn$;

-- Settles a half message still prepared (or check_exhausted: the producer's late answer
-- wins) as the Go client does (store.SettleHalf): committing locks its key like
-- txoutbox_enqueue and draws a new row id, so that it takes its place in its key's order
-- after every message of the key committed before it. Returns NULL when settled, else the
-- row's state ('' when there is no row), read by a statement of its own so that it sees what
-- a concurrent settle committed.
CREATE FUNCTION txoutbox_settle_half(p_id uuid, do_commit boolean) RETURNS text
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    st text;
BEGIN
    IF do_commit THEN
        PERFORM txoutbox_lock_key_hashes(ARRAY(SELECT partition_key FROM txoutbox_messages
            WHERE message_id = p_id AND msg_key IS NOT NULL AND state IN ('prepared', 'check_exhausted')));
        UPDATE txoutbox_messages SET id = DEFAULT, state = 'ready', ready_at = clock_timestamp(), next_attempt_at = now(),
            attempts = 0, next_check_at = NULL, settled_by = 'producer', settled_at = clock_timestamp()
        WHERE message_id = p_id AND state IN ('prepared', 'check_exhausted');
    ELSE
        UPDATE txoutbox_messages SET state = 'rolled_back', next_check_at = NULL, settled_by = 'producer',
            settled_at = clock_timestamp()
        WHERE message_id = p_id AND state IN ('prepared', 'check_exhausted');
    END IF;
    IF FOUND THEN
        RETURN NULL;
    END IF;
    SELECT state INTO st FROM txoutbox_messages WHERE message_id = p_id;
    RETURN coalesce(st, '');
END
$fn$;

-- Raises the error of a half message that could not be settled: TX101 rolled back, TX103 no
-- such message, TX102 already committed (ready, published or dead).
CREATE FUNCTION txoutbox_raise_settle(fn text, p_id uuid, st text) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $fn$
BEGIN
    IF st = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX103',
            MESSAGE = format('%s: id: message not found: no message has id %s (never prepared, or published and deleted, or purged)', fn, p_id);
    ELSIF st = 'rolled_back' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX101',
            MESSAGE = format('%s: id: half message %s is rolled_back: half message is rolled back', fn, p_id);
    ELSE
        RAISE EXCEPTION USING ERRCODE = 'TX102',
            MESSAGE = format('%s: id: half message %s is %s: half message is already committed', fn, p_id, st);
    END IF;
END
$fn$;

-- outbox.Client.Commit: commits a half message. Call it in a transaction of its own
-- (autocommit), then ring the doorbell. Raises TX101, TX102 or TX103 when the message is no
-- longer prepared.
CREATE FUNCTION txoutbox_commit(id uuid) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    st text := txoutbox_settle_half(id, true);
BEGIN
    IF st IS NOT NULL THEN
        PERFORM txoutbox_raise_settle('txoutbox_commit', id, st);
    END IF;
END
$fn$;

-- outbox.Client.CommitTx: commits a half message inside the caller's business transaction,
-- holding its row lock until that transaction ends (the check-back's fence skips it), so
-- that the message is published if and only if the transaction commits. Returns true when
-- this call committed it, false when it was already committed (the transaction stays
-- usable). Raises TX101 (typically: fenced by the check-back after its transaction timeout)
-- or TX103, which aborts the transaction: the business change and the message never disagree.
CREATE FUNCTION txoutbox_commit_in_tx(id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    st text := txoutbox_settle_half(id, true);
BEGIN
    IF st IS NULL THEN
        RETURN true;
    END IF;
    IF st NOT IN ('', 'rolled_back') THEN
        RETURN false;
    END IF;
    PERFORM txoutbox_raise_settle('txoutbox_commit_in_tx', id, st);
    RETURN false;
END
$fn$;

-- outbox.Client.Rollback: rolls back a half message (never published). Raises TX101, TX102
-- or TX103 when the message is no longer prepared.
CREATE FUNCTION txoutbox_rollback(id uuid) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    st text := txoutbox_settle_half(id, false);
BEGIN
    IF st IS NOT NULL THEN
        PERFORM txoutbox_raise_settle('txoutbox_rollback', id, st);
    END IF;
END
$fn$;

-- EXECUTE is granted explicitly (relay migrate grants --role producer), not to PUBLIC.
DO $do$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) AND p.proname LIKE 'txoutbox\_%' LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$do$;
