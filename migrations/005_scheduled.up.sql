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
