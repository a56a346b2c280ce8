-- txoutbox 009: the SQL producer functions agree with the Go client again where they did not.
--   * A delivery time is checked with the message, as the last of its checks (after its size,
--     before its id), by txoutbox_write's batch check: a batch is refused for its first bad
--     message, whatever is wrong with it, as EnqueueTx refuses it. Before, the delayed path
--     checked every message's content first and the delivery times after, so that an earlier
--     message bad only in its delivery time lost to a later one bad in its content, and an
--     id already in the outbox won over a bad delivery time. txoutbox_write takes the delivery
--     times (deliver_ats) and inserts delayed messages scheduled, in the same statement as the
--     others: no second statement turns them scheduled, and the delayed path costs what the
--     plain one does.
--   * Messages are numbered from 1 in every error of txoutbox_enqueue_many (the delivery
--     time's said 'message 0' for the first).
--   * A keyed delayed message takes no key lock (and does not count in txoutbox.key_locks):
--     it draws its final id under its key's lock when it falls due, as EnqueueTx's do.
--   * The all-zero UUID as an id is no id (outbox.Message.ID's uuid.Nil): one is drawn.
--   * txoutbox_enqueue_many checks its arrays' lengths before returning for no subjects, and
--     TX008 names the first argument whose length (or shape) is wrong, with its length.
--   * The message size limit can be set: txoutbox.max_message_bytes (a setting of the database,
--     the role or the session, as outbox.Config.MaxMessageBytes is of the Go client; 1048576
--     when unset), read by txoutbox_max_message_bytes. It was fixed at 1 MiB, so a Go client
--     configured for more and a SQL producer disagreed on the same outbox.
--   * A NULL id (txoutbox_commit, _commit_in_tx, _rollback, _cancel, _reschedule) or business
--     key (txoutbox_cancel_biz_key, _reschedule_biz_key) is refused with TX008 naming the
--     argument, and a business key is validated as CancelBizKeyTx validates it (TX002), before
--     the delivery time.
--   * txoutbox_cancel_biz_key and txoutbox_reschedule_biz_key find the rows' ids in a sub-select,
--     then update by id: under the producer grants' row-level security the business key index
--     was unusable in the UPDATE's own condition (its jsonb operators are not leakproof), so a
--     producer login scanned the whole table.

-- Whether d is a delivery time outbox.Message.DeliverAt accepts, 1970-01-01T00:00:00Z to
-- 9999-12-31T23:59:59Z (txoutbox_check_deliver_at refuses the others); NULL, none, is valid.
-- An inlinable predicate, as the other rules of txoutbox_write's batch check (004).
CREATE FUNCTION txoutbox_deliver_at_ok(d timestamptz) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
SELECT d IS NULL OR (d >= '1970-01-01 00:00:00+00'::timestamptz AND d <= '9999-12-31 23:59:59+00'::timestamptz)
$fn$;

-- The largest message (payload plus the header block NATS stores) the SQL producer functions
-- accept: the setting txoutbox.max_message_bytes (ALTER DATABASE ... SET, ALTER ROLE ... SET,
-- or SET for a session: set it to the Go clients' outbox.Config.MaxMessageBytes and below the
-- stream's max_msg_size and the server's max_payload), 1048576 (outbox.DefaultMaxMessageBytes)
-- when unset. A value that is not a whole number from 1024 to 33553374
-- (outbox.MaxMessageBytesLimit) is refused with SQLSTATE 22023 naming the setting.
CREATE FUNCTION txoutbox_max_message_bytes() RETURNS int
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $fn$
DECLARE
    v text := btrim(current_setting('txoutbox.max_message_bytes', true));
BEGIN
    IF v IS NULL OR v = '' THEN
        RETURN 1048576;
    END IF;
    IF v !~ '^[0-9]{1,9}$' OR v::int < 1024 OR v::int > 33553374 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('txoutbox.max_message_bytes: invalid setting %L: want a whole number of bytes from 1024 to 33553374 (outbox.MaxMessageBytesLimit), or unset for 1048576', v);
    END IF;
    RETURN v::int;
END
$fn$;

-- txoutbox_check_message as in 004, with the size limit txoutbox_max_message_bytes() instead
-- of 1048576.
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

-- Checks and writes messages, as txoutbox_write of migration 008 does, with their delivery
-- times (deliver_ats: NULL, or one per message, NULL for none): a delivery time outside
-- 1970-01-01..9999-12-31 UTC (TX009) is the message's last check, after its size and before
-- its id; a message with one is inserted scheduled (prepared, for check_mode) with it and
-- takes no key lock. The all-zero UUID in ids is no id.
CREATE FUNCTION txoutbox_write(fn text, numbered boolean, subjects text[], payloads bytea[], keys text[],
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

-- txoutbox_write without delivery times (migrations 004-008), for callers of that form: the
-- function above, with none.
CREATE OR REPLACE FUNCTION txoutbox_write(fn text, numbered boolean, subjects text[], payloads bytea[], keys text[],
    headers jsonb[], biz_keys text[], ids uuid[], producer_group text, check_mode text, check_immunity interval)
RETURNS uuid[]
LANGUAGE sql VOLATILE
AS $fn$
SELECT txoutbox_write(fn, numbered, subjects, payloads, keys, headers, biz_keys, ids, NULL::timestamptz[],
                      producer_group, check_mode, check_immunity)
$fn$;

-- EXECUTE on the new functions (the txoutbox_write that takes delivery times, and the predicate
-- and the size limit it calls with the caller's privileges), not to PUBLIC (004), goes to whoever may execute the
-- txoutbox_write they extend: its grantees (the producer roles granted before this migration)
-- and its owner (the owner of the earlier migrations' functions, when another role runs this
-- one), so that they keep enqueueing.
REVOKE EXECUTE ON FUNCTION txoutbox_write(text, boolean, text[], bytea[], text[], jsonb[], text[], uuid[], timestamptz[], text, text, interval),
    txoutbox_deliver_at_ok(timestamptz), txoutbox_max_message_bytes() FROM PUBLIC;
DO $do$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT g.grantee, f.oid::regprocedure AS fn FROM pg_proc o
             CROSS JOIN LATERAL (SELECT a.grantee FROM aclexplode(o.proacl) a WHERE a.privilege_type = 'EXECUTE'
                                 UNION ALL SELECT o.proowner) g
             CROSS JOIN pg_proc f
             WHERE o.oid = 'txoutbox_write(text, boolean, text[], bytea[], text[], jsonb[], text[], uuid[], text, text, interval)'::regprocedure
               AND f.oid IN ('txoutbox_write(text, boolean, text[], bytea[], text[], jsonb[], text[], uuid[], timestamptz[], text, text, interval)'::regprocedure,
                             'txoutbox_deliver_at_ok(timestamptz)'::regprocedure,
                             'txoutbox_max_message_bytes()'::regprocedure)
               AND g.grantee <> f.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', r.fn,
                       CASE WHEN r.grantee = 0 THEN 'PUBLIC' ELSE r.grantee::regrole::text END);
    END LOOP;
END
$do$;

-- txoutbox_enqueue: one message, its delivery time checked and stored with it.
CREATE OR REPLACE FUNCTION txoutbox_enqueue(subject text, payload bytea, key text DEFAULT NULL, headers jsonb DEFAULT NULL,
    biz_key text DEFAULT NULL, id uuid DEFAULT NULL, deliver_at timestamptz DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
BEGIN
    RETURN (txoutbox_write('txoutbox_enqueue', false, ARRAY[subject], ARRAY[payload], ARRAY[key], ARRAY[headers],
                           ARRAY[biz_key], ARRAY[id], ARRAY[deliver_at], NULL, NULL, NULL))[1];
END
$fn$;

-- txoutbox_enqueue_many: its arrays are checked first, also when there is no subject (TX008
-- names the first argument whose length or shape is wrong), then every message as one batch,
-- delivery times included.
CREATE OR REPLACE FUNCTION txoutbox_enqueue_many(subjects text[], payloads bytea[], keys text[] DEFAULT NULL,
    headers jsonb[] DEFAULT NULL, biz_keys text[] DEFAULT NULL, ids uuid[] DEFAULT NULL, deliver_ats timestamptz[] DEFAULT NULL)
RETURNS uuid[]
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    n int := coalesce(cardinality(subjects), 0);
    arg record;
BEGIN
    IF coalesce(array_ndims(subjects), 1) <> 1
       OR (payloads IS NULL AND n > 0) OR coalesce(cardinality(payloads), n) <> n OR coalesce(array_ndims(payloads), 1) <> 1
       OR coalesce(cardinality(keys), n) <> n OR coalesce(array_ndims(keys), 1) <> 1
       OR coalesce(cardinality(headers), n) <> n OR coalesce(array_ndims(headers), 1) <> 1
       OR coalesce(cardinality(biz_keys), n) <> n OR coalesce(array_ndims(biz_keys), 1) <> 1
       OR coalesce(cardinality(ids), n) <> n OR coalesce(array_ndims(ids), 1) <> 1
       OR coalesce(cardinality(deliver_ats), n) <> n OR coalesce(array_ndims(deliver_ats), 1) <> 1 THEN
        SELECT a.name, a.len, a.dims INTO arg
        FROM (VALUES (1, 'subjects', n, array_ndims(subjects)), (2, 'payloads', cardinality(payloads), array_ndims(payloads)),
                     (3, 'keys', cardinality(keys), array_ndims(keys)), (4, 'headers', cardinality(headers), array_ndims(headers)),
                     (5, 'biz_keys', cardinality(biz_keys), array_ndims(biz_keys)), (6, 'ids', cardinality(ids), array_ndims(ids)),
                     (7, 'deliver_ats', cardinality(deliver_ats), array_ndims(deliver_ats))) AS a(ord, name, len, dims)
        WHERE coalesce(a.dims, 1) <> 1 OR (a.len IS NULL AND a.name = 'payloads' AND n > 0) OR coalesce(a.len, n) <> n
        ORDER BY a.ord LIMIT 1;
        IF coalesce(arg.dims, 1) <> 1 THEN
            RAISE EXCEPTION USING ERRCODE = 'TX008',
                MESSAGE = format('txoutbox_enqueue_many: %1$s: invalid argument: %1$s is a %2$s-dimensional array: the arrays must be one-dimensional', arg.name, arg.dims);
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = format('txoutbox_enqueue_many: %1$s: invalid argument: %1$s %2$s and subjects has %3$s: payloads, and keys, headers, biz_keys, ids and deliver_ats when not NULL, must have one element per subject',
                             arg.name, CASE WHEN arg.len IS NULL THEN 'is NULL' WHEN arg.len = 1 THEN 'has 1 element' ELSE format('has %s elements', arg.len) END,
                             CASE WHEN n = 1 THEN '1 element' ELSE format('%s elements', n) END);
    END IF;
    IF n = 0 THEN
        RETURN '{}';
    END IF;
    RETURN txoutbox_write('txoutbox_enqueue_many', true, subjects, payloads, keys, headers, biz_keys, ids, deliver_ats, NULL, NULL, NULL);
END
$fn$;

-- txoutbox_prepare: check_immunity, then producer_group (as Prepare checks its options), then
-- the message with its delivery time.
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

-- The settle, cancel and reschedule functions refuse a NULL id (TX008), which they reported
-- as a message not found with a blank id. txoutbox_reschedule records its time in settled_at,
-- as RescheduleTx does.
CREATE OR REPLACE FUNCTION txoutbox_commit(id uuid) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    st text;
BEGIN
    IF id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = 'txoutbox_commit: id: invalid argument: id is NULL: pass the id txoutbox_prepare returned';
    END IF;
    st := txoutbox_settle_half(id, true);
    IF st IS NOT NULL THEN
        PERFORM txoutbox_raise_settle('txoutbox_commit', id, st);
    END IF;
END
$fn$;

CREATE OR REPLACE FUNCTION txoutbox_commit_in_tx(id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    st text;
BEGIN
    IF id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = 'txoutbox_commit_in_tx: id: invalid argument: id is NULL: pass the id txoutbox_prepare returned';
    END IF;
    st := txoutbox_settle_half(id, true);
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

CREATE OR REPLACE FUNCTION txoutbox_rollback(id uuid) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    st text;
BEGIN
    IF id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = 'txoutbox_rollback: id: invalid argument: id is NULL: pass the id txoutbox_prepare returned';
    END IF;
    st := txoutbox_settle_half(id, false);
    IF st IS NOT NULL THEN
        PERFORM txoutbox_raise_settle('txoutbox_rollback', id, st);
    END IF;
END
$fn$;

CREATE OR REPLACE FUNCTION txoutbox_cancel(id uuid) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    st text;
BEGIN
    IF id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = 'txoutbox_cancel: id: invalid argument: id is NULL: pass the id of the scheduled message';
    END IF;
    UPDATE txoutbox_messages m SET state = 'rolled_back', settled_by = 'cancel', settled_at = clock_timestamp()
    WHERE m.message_id = txoutbox_cancel.id AND m.state = 'scheduled';
    IF FOUND THEN
        RETURN;
    END IF;
    SELECT m.state INTO st FROM txoutbox_messages m WHERE m.message_id = txoutbox_cancel.id;
    PERFORM txoutbox_raise_not_scheduled('txoutbox_cancel', id, coalesce(st, ''));
END
$fn$;

CREATE OR REPLACE FUNCTION txoutbox_reschedule(id uuid, deliver_at timestamptz) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    st text;
BEGIN
    IF id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'TX008',
            MESSAGE = 'txoutbox_reschedule: id: invalid argument: id is NULL: pass the id of the scheduled message';
    END IF;
    PERFORM txoutbox_check_deliver_at('txoutbox_reschedule', deliver_at);
    UPDATE txoutbox_messages m SET deliver_at = txoutbox_reschedule.deliver_at, settled_at = clock_timestamp()
    WHERE m.message_id = txoutbox_reschedule.id AND m.state = 'scheduled';
    IF FOUND THEN
        RETURN;
    END IF;
    SELECT m.state INTO st FROM txoutbox_messages m WHERE m.message_id = txoutbox_reschedule.id;
    PERFORM txoutbox_raise_not_scheduled('txoutbox_reschedule', id, coalesce(st, ''));
END
$fn$;

-- The business key forms: NULL is refused (TX008), an empty or invalid business key too
-- (TX002, as CancelBizKeyTx and RescheduleBizKeyTx refuse it with ErrInvalidKey), before the
-- delivery time. A reschedule records its time in settled_at, as RescheduleTx does (the
-- relay's lateness counts from the later of the delivery time and that time). The rows are
-- found by a sub-select, then updated by id, as CancelBizKeyTx and RescheduleBizKeyTx do: for
-- a producer login under row-level security (`relay migrate grants --role producer`) the
-- UPDATE's own condition on the business key could not use its index (the jsonb operators are
-- not leakproof) and would scan the whole table.
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
