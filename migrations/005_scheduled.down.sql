-- Reverting 005 would have to publish scheduled messages early or drop them: refuse instead.
DO $$
DECLARE n bigint;
BEGIN
    SELECT count(*) INTO n FROM txoutbox_messages WHERE state = 'scheduled' OR (deliver_at IS NOT NULL AND state IN ('prepared', 'check_exhausted'));
    IF n > 0 THEN
        RAISE EXCEPTION 'txoutbox 005 down: % messages are scheduled (or prepared with a delivery time); cancel them (relay scheduled cancel) or let them be published first', n;
    END IF;
END $$;

DROP INDEX txoutbox_messages_scheduled_biz_key_idx;
DROP INDEX txoutbox_messages_scheduled_key_idx;
DROP INDEX txoutbox_messages_scheduled_idx;
ALTER TABLE txoutbox_messages DROP CONSTRAINT txoutbox_messages_state_check;
ALTER TABLE txoutbox_messages ADD CONSTRAINT txoutbox_messages_state_check
    CHECK (state IN ('prepared', 'ready', 'published', 'rolled_back', 'dead', 'check_exhausted'));
ALTER TABLE txoutbox_messages DROP COLUMN deliver_at;
DROP FUNCTION txoutbox_settle_half(uuid, boolean);
DROP FUNCTION txoutbox_prepare(text, bytea, text, jsonb, text, uuid, text, boolean, interval, timestamptz);
DROP FUNCTION txoutbox_enqueue_many(text[], bytea[], text[], jsonb[], text[], uuid[], timestamptz[]);
DROP FUNCTION txoutbox_enqueue(text, bytea, text, jsonb, text, uuid, timestamptz);
ALTER FUNCTION txoutbox_settle_half_v4(uuid, boolean) RENAME TO txoutbox_settle_half;
ALTER FUNCTION txoutbox_prepare_v4(text, bytea, text, jsonb, text, uuid, text, boolean, interval) RENAME TO txoutbox_prepare;
ALTER FUNCTION txoutbox_enqueue_many_v4(text[], bytea[], text[], jsonb[], text[], uuid[]) RENAME TO txoutbox_enqueue_many;
ALTER FUNCTION txoutbox_enqueue_v4(text, bytea, text, jsonb, text, uuid) RENAME TO txoutbox_enqueue;
DROP FUNCTION txoutbox_reschedule_biz_key(text, timestamptz);
DROP FUNCTION txoutbox_cancel_biz_key(text);
DROP FUNCTION txoutbox_reschedule(uuid, timestamptz);
DROP FUNCTION txoutbox_cancel(uuid);
DROP FUNCTION txoutbox_check_deliver_at(text, timestamptz);
DROP FUNCTION txoutbox_raise_not_scheduled(text, uuid, text);
