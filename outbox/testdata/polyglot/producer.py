"""txoutbox's SQL contract from Python (psycopg 3), run by outbox's TestSQLProducerPython.

The connection is in autocommit mode, so that conn.transaction() is BEGIN ... COMMIT; the
functions are on its search_path (the outbox schema). The environment (PGHOST, PGOPTIONS, ...)
says where to connect.
"""
import json
import sys

import psycopg
from psycopg.types.json import Jsonb


# snippet:python
def place_order(conn, order_id):
    """Marks the order created and enqueues its event, in one transaction."""
    with conn.transaction():
        conn.execute("UPDATE orders SET status = 'created' WHERE id = %s", (order_id,))
        (msg_id,) = conn.execute(
            "SELECT txoutbox_enqueue(subject => %s, payload => %s, key => %s, headers => %s, biz_key => %s)",
            ("orders.created", json.dumps({"order": order_id}).encode(), f"order-{order_id}",
             Jsonb({"traceparent": ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"]}),
             f"order:{order_id}:created"),
        ).fetchone()
    conn.execute("SELECT pg_notify('txoutbox_doorbell', '')")  # after the commit: wake the relay
    return msg_id


def ship_orders(conn, order_ids):
    """Enqueues one event per order, in order, in one round trip."""
    with conn.transaction():
        (msg_ids,) = conn.execute(
            "SELECT txoutbox_enqueue_many(subjects => %s, payloads => %s, keys => %s)",
            (["orders.shipped"] * len(order_ids),
             [json.dumps({"order": i}).encode() for i in order_ids],
             [f"order-{i}" for i in order_ids]),
        ).fetchone()
    conn.execute("SELECT pg_notify('txoutbox_doorbell', '')")
    return msg_ids


def pay_order(conn, order_id):
    """A half message: stored first (autocommit), committed with the business change."""
    (half_id,) = conn.execute(
        "SELECT txoutbox_prepare(%s, %s, key => %s, producer_group => 'payments')",
        ("orders.paid", json.dumps({"order": order_id}).encode(), f"order-{order_id}"),
    ).fetchone()
    with conn.transaction():
        conn.execute("UPDATE orders SET status = 'paid' WHERE id = %s", (order_id,))
        conn.execute("SELECT txoutbox_commit_in_tx(%s)", (half_id,))
    conn.execute("SELECT pg_notify('txoutbox_doorbell', '')")
    return half_id


def try_enqueue(conn, subject, payload):
    """The message id, or None when txoutbox refuses the message (SQLSTATE class TX)."""
    try:
        with conn.transaction():
            (msg_id,) = conn.execute("SELECT txoutbox_enqueue(%s, %s)", (subject, payload)).fetchone()
        return msg_id
    except psycopg.Error as e:
        if e.sqlstate is None or not e.sqlstate.startswith("TX"):
            raise
        print(f"refused {e.sqlstate}: {e.diag.message_primary}", file=sys.stderr)
        return None
# snippet:end


def main():
    with psycopg.connect(autocommit=True) as conn:
        print("enqueued", place_order(conn, 42))
        print("many", ",".join(str(i) for i in ship_orders(conn, [1, 2, 3])))
        print("half", pay_order(conn, 7))
        try:
            with conn.transaction():
                conn.execute("SELECT txoutbox_enqueue('orders..created', '')")
        except psycopg.Error as e:
            print("refused", e.sqlstate)
        print("try_enqueue", try_enqueue(conn, "orders.*", b"{}"))


if __name__ == "__main__":
    main()
