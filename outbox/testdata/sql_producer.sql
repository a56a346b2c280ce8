-- txoutbox: producing from plain SQL, as any client in any language can (README, "The SQL
-- contract"). Run with the outbox schema on the search_path (or qualify the functions):
--   PGOPTIONS='-c search_path=txoutbox' psql -X -v ON_ERROR_STOP=1 -f sql_producer.sql
-- The test suite runs this file (outbox/sqlfn_half_test.go: TestPlainSQLExample).

-- 1. Messages in the business transaction: written if and only if it commits.
BEGIN;
-- UPDATE orders SET status = 'created' WHERE id = 42;   -- the business change
SELECT txoutbox_enqueue(
    subject => 'orders.created',
    payload => convert_to('{"order":42}', 'UTF8'),
    key     => 'order-42',                                  -- per-key order
    headers => '{"traceparent": ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"]}',
    biz_key => 'order:42:created');                         -- consumers dedup on it
-- Many messages in one call (one round trip), ids returned in order.
SELECT txoutbox_enqueue_many(
    ARRAY['orders.line_added', 'orders.line_added'],
    ARRAY[convert_to('{"line":1}', 'UTF8'), convert_to('{"line":2}', 'UTF8')],
    keys => ARRAY['order-42', 'order-42']);
COMMIT;
-- Ring the doorbell after the commit (never inside the transaction): the relay, run with
-- --doorbell-channel txoutbox_doorbell, publishes at once instead of at its next poll.
SELECT pg_notify('txoutbox_doorbell', '');

-- 2. A half message: stored first (in a transaction of its own), invisible to the relay...
SELECT set_config('example.half_id',
    txoutbox_prepare(subject => 'payments.captured', payload => convert_to('{"order":42}', 'UTF8'),
                     key => 'order-42', fence => true)::text, false);
-- ... then committed inside the business transaction that does the work: published if and
-- only if this transaction commits (true: this call committed it).
BEGIN;
-- UPDATE payments SET captured = true WHERE order_id = 42;
SELECT txoutbox_commit_in_tx(current_setting('example.half_id')::uuid);
COMMIT;
SELECT pg_notify('txoutbox_doorbell', '');

-- 3. A half message whose work failed: rolled back, never published.
SELECT set_config('example.half_id',
    txoutbox_prepare(subject => 'payments.captured', payload => convert_to('{"order":43}', 'UTF8'),
                     producer_group => 'payments')::text, false);
SELECT txoutbox_rollback(current_setting('example.half_id')::uuid);
