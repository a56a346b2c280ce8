// txoutbox's SQL contract from Node (node-postgres), run by outbox's TestSQLProducerNode. The
// environment (PGHOST, PGOPTIONS, ...) says where to connect; the functions are on the
// connection's search_path (the outbox schema).
'use strict';
const { Client } = require('pg');

// snippet:node
// Marks the order created and enqueues its event, in one transaction.
async function placeOrder(client, orderId) {
  let id;
  await client.query('BEGIN');
  try {
    await client.query("UPDATE orders SET status = 'created' WHERE id = $1", [orderId]);
    const res = await client.query(
      'SELECT txoutbox_enqueue(subject => $1, payload => $2, key => $3, headers => $4, biz_key => $5) AS id',
      ['orders.created', Buffer.from(JSON.stringify({ order: orderId })), `order-${orderId}`,
        JSON.stringify({ traceparent: ['00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'] }),
        `order:${orderId}:created`]);
    id = res.rows[0].id;
    await client.query('COMMIT');
  } catch (e) {
    await client.query('ROLLBACK');
    throw e;
  }
  await client.query("SELECT pg_notify('txoutbox_doorbell', '')"); // after the commit: wake the relay
  return id;
}

// Enqueues one event per order, in order, in one round trip.
async function shipOrders(client, orderIds) {
  let ids;
  await client.query('BEGIN');
  try {
    const res = await client.query(
      'SELECT txoutbox_enqueue_many(subjects => $1, payloads => $2, keys => $3) AS ids',
      [orderIds.map(() => 'orders.shipped'), orderIds.map((i) => Buffer.from(JSON.stringify({ order: i }))),
        orderIds.map((i) => `order-${i}`)]);
    ids = res.rows[0].ids;
    await client.query('COMMIT');
  } catch (e) {
    await client.query('ROLLBACK');
    throw e;
  }
  await client.query("SELECT pg_notify('txoutbox_doorbell', '')");
  return ids;
}

// A half message: stored first (autocommit), committed with the business change.
async function payOrder(client, orderId) {
  const prep = await client.query(
    "SELECT txoutbox_prepare($1, $2, key => $3, producer_group => 'payments') AS id",
    ['orders.paid', Buffer.from(JSON.stringify({ order: orderId })), `order-${orderId}`]);
  const halfId = prep.rows[0].id;
  await client.query('BEGIN');
  try {
    await client.query("UPDATE orders SET status = 'paid' WHERE id = $1", [orderId]);
    await client.query('SELECT txoutbox_commit_in_tx($1)', [halfId]);
    await client.query('COMMIT');
  } catch (e) {
    await client.query('ROLLBACK');
    throw e;
  }
  await client.query("SELECT pg_notify('txoutbox_doorbell', '')");
  return halfId;
}

// The message id, or null when txoutbox refuses the message (SQLSTATE class TX).
async function tryEnqueue(client, subject, payload) {
  try {
    const res = await client.query('SELECT txoutbox_enqueue($1, $2) AS id', [subject, payload]);
    return res.rows[0].id;
  } catch (e) {
    if (typeof e.code !== 'string' || !e.code.startsWith('TX')) {
      throw e;
    }
    console.error(`refused ${e.code}: ${e.message}`);
    return null;
  }
}
// snippet:end

async function main() {
  const client = new Client();
  await client.connect();
  try {
    console.log('enqueued', await placeOrder(client, 42));
    console.log('many', (await shipOrders(client, [1, 2, 3])).join(','));
    console.log('half', await payOrder(client, 7));
    try {
      await client.query("SELECT txoutbox_enqueue('orders..created', '')");
    } catch (e) {
      console.log('refused', e.code);
    }
    console.log('try_enqueue', await tryEnqueue(client, 'orders.*', Buffer.from('{}')));
  } finally {
    await client.end();
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
