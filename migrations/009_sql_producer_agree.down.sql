-- Reverts 009: the definitions of migrations 004, 005, 007 and 008 of the functions 009
-- replaced, and the txoutbox_write that takes delivery times and txoutbox_deliver_at_ok
-- dropped.

-- 008's txoutbox_write.

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

-- 007's txoutbox_enqueue, txoutbox_enqueue_many and txoutbox_prepare.

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

-- 004's txoutbox_commit, txoutbox_commit_in_tx and txoutbox_rollback.

CREATE OR REPLACE FUNCTION txoutbox_commit(id uuid) RETURNS void
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

CREATE OR REPLACE FUNCTION txoutbox_commit_in_tx(id uuid) RETURNS boolean
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

CREATE OR REPLACE FUNCTION txoutbox_rollback(id uuid) RETURNS void
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

-- 005's txoutbox_cancel, txoutbox_reschedule and their business key forms.

CREATE OR REPLACE FUNCTION txoutbox_cancel(id uuid) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    st text;
BEGIN
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
    PERFORM txoutbox_check_deliver_at('txoutbox_reschedule', deliver_at);
    UPDATE txoutbox_messages m SET deliver_at = txoutbox_reschedule.deliver_at
    WHERE m.message_id = txoutbox_reschedule.id AND m.state = 'scheduled';
    IF FOUND THEN
        RETURN;
    END IF;
    SELECT m.state INTO st FROM txoutbox_messages m WHERE m.message_id = txoutbox_reschedule.id;
    PERFORM txoutbox_raise_not_scheduled('txoutbox_reschedule', id, coalesce(st, ''));
END
$fn$;

CREATE OR REPLACE FUNCTION txoutbox_cancel_biz_key(biz_key text) RETURNS uuid[]
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    ids uuid[];
BEGIN
    WITH d AS (
        UPDATE txoutbox_messages m SET state = 'rolled_back', settled_by = 'cancel', settled_at = clock_timestamp()
        WHERE (m.headers -> 'Txoutbox-Biz-Key' ->> 0) = txoutbox_cancel_biz_key.biz_key AND m.state = 'scheduled'
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
    PERFORM txoutbox_check_deliver_at('txoutbox_reschedule_biz_key', deliver_at);
    WITH u AS (
        UPDATE txoutbox_messages m SET deliver_at = txoutbox_reschedule_biz_key.deliver_at
        WHERE (m.headers -> 'Txoutbox-Biz-Key' ->> 0) = txoutbox_reschedule_biz_key.biz_key AND m.state = 'scheduled'
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

DROP FUNCTION txoutbox_write(text, boolean, text[], bytea[], text[], jsonb[], text[], uuid[], timestamptz[], text, text, interval);
DROP FUNCTION txoutbox_deliver_at_ok(timestamptz);

-- txoutbox_check_message as 004 made it (the limit fixed at 1048576).
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

DROP FUNCTION txoutbox_max_message_bytes();
