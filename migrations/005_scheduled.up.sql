-- txoutbox 005: delayed (scheduled) messages.
--
-- A message with a delivery time is stored in state 'scheduled' with deliver_at set. The
-- relay's claim never reads scheduled rows (its index holds ready rows only), so a scheduled
-- row costs the claim nothing however far ahead it is due. Each relay pass promotes the rows
-- that fell due (an index range scan over txoutbox_messages_scheduled_idx that stops at the
-- first row not yet due) to 'ready', drawing them a new id under their key's lock, so that for
-- one key id order stays the order in which rows became ready. Until then a scheduled row can
-- be cancelled (state rolled_back, settled_by 'cancel': purged with the rolled-back rows) or
-- rescheduled (deliver_at changed) in any transaction.

ALTER TABLE txoutbox_messages ADD COLUMN deliver_at timestamptz;

ALTER TABLE txoutbox_messages DROP CONSTRAINT txoutbox_messages_state_check;
ALTER TABLE txoutbox_messages ADD CONSTRAINT txoutbox_messages_state_check
    CHECK (state IN ('prepared', 'ready', 'published', 'rolled_back', 'dead', 'check_exhausted', 'scheduled'));

-- Promotion (and the next due time): scheduled rows by due time.
CREATE INDEX txoutbox_messages_scheduled_idx ON txoutbox_messages (deliver_at, id) WHERE state = 'scheduled';

-- Promotion keeps a key's order: a row is promoted only when no earlier scheduled row of its
-- key is left behind (locked by a cancel in progress, or taken by another relay's pass).
CREATE INDEX txoutbox_messages_scheduled_key_idx ON txoutbox_messages (msg_key, deliver_at, id)
    WHERE state = 'scheduled' AND msg_key IS NOT NULL;

-- Cancelling and rescheduling by business key (the Txoutbox-Biz-Key header).
CREATE INDEX txoutbox_messages_scheduled_biz_key_idx ON txoutbox_messages ((headers -> 'Txoutbox-Biz-Key' ->> 0))
    WHERE state = 'scheduled';

-- The SQL contract (migration 004) for delayed messages: outbox.Client.CancelTx, RescheduleTx
-- and their business key forms. Errors: TX009 invalid delivery time (outside
-- 1970-01-01..9999-12-31 UTC, outbox.ErrInvalidDeliverAt), TX201 not scheduled
-- (outbox.ErrNotScheduled: it fell due and the relay took it, it was cancelled, it is an
-- uncommitted half message, or it does not exist).

-- Raises TX201 for message p_id in state st ('' when there is no such message).
CREATE FUNCTION txoutbox_raise_not_scheduled(fn text, p_id uuid, st text) RETURNS void
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

-- Raises TX009 unless deliver_at is a delivery time outbox.Message.DeliverAt accepts.
CREATE FUNCTION txoutbox_check_deliver_at(fn text, deliver_at timestamptz) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $fn$
BEGIN
    IF deliver_at IS NULL OR deliver_at < '1970-01-01 00:00:00+00' OR deliver_at > '9999-12-31 23:59:59+00' THEN
        RAISE EXCEPTION USING ERRCODE = 'TX009',
            MESSAGE = format('%s: deliver_at: invalid delivery time: %s is outside 1970-01-01T00:00:00Z..9999-12-31T23:59:59Z', fn, coalesce(deliver_at::text, 'NULL'));
    END IF;
END
$fn$;

-- outbox.Client.CancelTx: withdraws a scheduled message inside the caller's transaction (its
-- row lock is held until the transaction ends; the relay skips a row so locked). Raises
-- TX201 when it is not scheduled.
CREATE FUNCTION txoutbox_cancel(id uuid) RETURNS void
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

-- outbox.Client.RescheduleTx: moves a scheduled message's delivery time. Raises TX009 or TX201.
CREATE FUNCTION txoutbox_reschedule(id uuid, deliver_at timestamptz) RETURNS void
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

-- outbox.Client.CancelBizKeyTx: withdraws every scheduled message of a business key and
-- returns their ids. Raises TX201 when there is none.
CREATE FUNCTION txoutbox_cancel_biz_key(biz_key text) RETURNS uuid[]
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

-- outbox.Client.RescheduleBizKeyTx: moves the delivery time of every scheduled message of a
-- business key and returns their ids. Raises TX009 or TX201.
CREATE FUNCTION txoutbox_reschedule_biz_key(biz_key text, deliver_at timestamptz) RETURNS uuid[]
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

REVOKE EXECUTE ON FUNCTION txoutbox_raise_not_scheduled(text, uuid, text), txoutbox_check_deliver_at(text, timestamptz),
    txoutbox_cancel(uuid), txoutbox_reschedule(uuid, timestamptz),
    txoutbox_cancel_biz_key(text), txoutbox_reschedule_biz_key(text, timestamptz) FROM PUBLIC;

-- txoutbox_enqueue, txoutbox_enqueue_many and txoutbox_prepare take a delivery time
-- (outbox.Message.DeliverAt): a trailing deliver_at (deliver_ats for the batch form, one per
-- message, NULL for none) DEFAULT NULL. Migration 004's functions are kept under the names
-- *_v4 and do the validation, the key locks and the insert; the new functions call them and,
-- for a delayed message, turn the row just inserted (not yet committed: the relay never sees it
-- ready) scheduled. txoutbox_settle_half likewise makes a committed half message with a
-- delivery time scheduled. EXECUTE privileges of the old functions carry over to the new ones.
ALTER FUNCTION txoutbox_enqueue(text, bytea, text, jsonb, text, uuid) RENAME TO txoutbox_enqueue_v4;
ALTER FUNCTION txoutbox_enqueue_many(text[], bytea[], text[], jsonb[], text[], uuid[]) RENAME TO txoutbox_enqueue_many_v4;
ALTER FUNCTION txoutbox_prepare(text, bytea, text, jsonb, text, uuid, text, boolean, interval) RENAME TO txoutbox_prepare_v4;
ALTER FUNCTION txoutbox_settle_half(uuid, boolean) RENAME TO txoutbox_settle_half_v4;

CREATE FUNCTION txoutbox_enqueue(subject text, payload bytea, key text DEFAULT NULL, headers jsonb DEFAULT NULL,
    biz_key text DEFAULT NULL, id uuid DEFAULT NULL, deliver_at timestamptz DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    mid uuid;
BEGIN
    IF deliver_at IS NULL THEN
        RETURN txoutbox_enqueue_v4(subject, payload, key, headers, biz_key, id);
    END IF;
    -- The message's own checks first, as EnqueueTx makes them (an error undoes the insert).
    mid := txoutbox_enqueue_v4(subject, payload, key, headers, biz_key, id);
    PERFORM txoutbox_check_deliver_at('txoutbox_enqueue', deliver_at);
    UPDATE txoutbox_messages m SET state = 'scheduled', ready_at = NULL, deliver_at = txoutbox_enqueue.deliver_at
    WHERE m.message_id = mid;
    RETURN mid;
END
$fn$;

CREATE FUNCTION txoutbox_enqueue_many(subjects text[], payloads bytea[], keys text[] DEFAULT NULL,
    headers jsonb[] DEFAULT NULL, biz_keys text[] DEFAULT NULL, ids uuid[] DEFAULT NULL, deliver_ats timestamptz[] DEFAULT NULL)
RETURNS uuid[]
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    out_ids uuid[];
    bad int;
BEGIN
    IF deliver_ats IS NULL THEN
        RETURN txoutbox_enqueue_many_v4(subjects, payloads, keys, headers, biz_keys, ids);
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

CREATE FUNCTION txoutbox_prepare(subject text, payload bytea, key text DEFAULT NULL, headers jsonb DEFAULT NULL,
    biz_key text DEFAULT NULL, id uuid DEFAULT NULL, producer_group text DEFAULT NULL, fence boolean DEFAULT false,
    check_immunity interval DEFAULT NULL, deliver_at timestamptz DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
DECLARE
    mid uuid;
BEGIN
    mid := txoutbox_prepare_v4(subject, payload, key, headers, biz_key, id, producer_group, fence, check_immunity);
    IF deliver_at IS NOT NULL THEN
        PERFORM txoutbox_check_deliver_at('txoutbox_prepare', deliver_at);
        UPDATE txoutbox_messages m SET deliver_at = txoutbox_prepare.deliver_at WHERE m.message_id = mid;
    END IF;
    RETURN mid;
END
$fn$;

CREATE FUNCTION txoutbox_settle_half(p_id uuid, do_commit boolean) RETURNS text
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    st text := txoutbox_settle_half_v4(p_id, do_commit);
BEGIN
    IF do_commit AND st IS NULL THEN
        UPDATE txoutbox_messages SET state = 'scheduled', ready_at = NULL
        WHERE message_id = p_id AND state = 'ready' AND deliver_at IS NOT NULL;
    END IF;
    RETURN st;
END
$fn$;

DO $do$
DECLARE
    p record;
    g record;
BEGIN
    FOR p IN SELECT o.oid AS old_fn, n.oid::regprocedure AS new_fn
             FROM pg_proc o JOIN pg_proc n ON n.pronamespace = o.pronamespace AND n.proname || '_v4' = o.proname
             WHERE o.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
               AND o.proname IN ('txoutbox_enqueue_v4', 'txoutbox_enqueue_many_v4', 'txoutbox_prepare_v4', 'txoutbox_settle_half_v4') LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', p.new_fn);
        FOR g IN SELECT a.grantee FROM pg_proc o, aclexplode(o.proacl) a
                 WHERE o.oid = p.old_fn AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> o.proowner LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', p.new_fn, g.grantee::regrole); -- regrole's text is quoted as needed
        END LOOP;
    END LOOP;
END
$do$;

-- Roles granted the producer's privileges before this migration (relay migrate grants --role
-- producer at migration 4) keep working without a new grant: a half message's commit now
-- reads deliver_at (Go's Commit and txoutbox_settle_half), and CancelTx, RescheduleTx and
-- their SQL functions need it too. Every role that may settle half messages (UPDATE of
-- check_count) gets the new column privileges; every role that may call txoutbox_commit gets
-- EXECUTE on the new functions. Roles with table-wide privileges (the relay, owners) have
-- them already.
DO $do$
DECLARE
    r record;
    f regprocedure;
BEGIN
    FOR r IN SELECT a.rolname FROM pg_roles a
             WHERE NOT a.rolsuper AND a.rolname NOT LIKE 'pg\_%'
               AND has_column_privilege(a.oid, 'txoutbox_messages'::regclass, 'check_count', 'UPDATE')
               AND NOT has_column_privilege(a.oid, 'txoutbox_messages'::regclass, 'deliver_at', 'UPDATE') LOOP
        EXECUTE format('GRANT SELECT (deliver_at, headers), UPDATE (deliver_at) ON txoutbox_messages TO %I', r.rolname);
    END LOOP;
    FOR r IN SELECT a.rolname FROM pg_roles a
             WHERE NOT a.rolsuper AND a.rolname NOT LIKE 'pg\_%'
               AND a.oid <> (SELECT p.proowner FROM pg_proc p WHERE p.oid = 'txoutbox_commit(uuid)'::regprocedure)
               AND has_function_privilege(a.oid, 'txoutbox_commit(uuid)'::regprocedure, 'EXECUTE') LOOP
        FOREACH f IN ARRAY ARRAY['txoutbox_raise_not_scheduled(text, uuid, text)', 'txoutbox_check_deliver_at(text, timestamptz)',
                                 'txoutbox_cancel(uuid)', 'txoutbox_reschedule(uuid, timestamptz)',
                                 'txoutbox_cancel_biz_key(text)', 'txoutbox_reschedule_biz_key(text, timestamptz)']::regprocedure[] LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', f, r.rolname);
        END LOOP;
    END LOOP;
END
$do$;
