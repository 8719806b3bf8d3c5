#!/usr/bin/env node
// Record an order and enqueue its confirmation email in one transaction, through
// postie's transactional outbox (see "Transactional outbox" in the README).
//
//   npm ci --prefix examples/node
//   postie outbox install --database postgres://app@127.0.0.1/shop   # once
//   node examples/node/outbox.js --to alice@example.com --delay-ms 10000
//
// The order row and the email job commit together or not at all: postie's relay
// (`outbox.sources` in `postie serve`) publishes the job after the commit, and the
// inbox's key makes it one email. A job rolled back with the order is never sent.
//
// Every setting is a flag, or else an environment variable, or else a default:
//
//   --database-url  PRODUCER_DATABASE_URL  postgres://postgres@127.0.0.1:5432/shop
//   --order-id      ORDER_ID               <unix ms>
//   --to            EMAIL_TO               alice@example.com
//   --delay-ms      EMAIL_DELAY_MS         5000     (0 = send now)
//   --rollback                                      (roll the transaction back instead)
//
// On success it prints "enqueued key=<key> outbox_id=<id> delay_ms=<n>" after the
// commit, or with --rollback "rolled back key=<key>". Any failure exits non-zero: a
// refused job (postie.enqueue checks the key and the recipients) rolls the order back
// with it.
'use strict';

const { parseArgs } = require('node:util');
const { Client } = require('pg');

// The shop's own table; in a real service this is your business data.
const ORDERS_TABLE = `
CREATE TABLE IF NOT EXISTS example_orders (
    id         text PRIMARY KEY,
    email      text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)`;

function settings() {
  const { values } = parseArgs({
    options: {
      'database-url': { type: 'string' },
      'order-id': { type: 'string' },
      to: { type: 'string' },
      'delay-ms': { type: 'string' },
      rollback: { type: 'boolean' },
    },
  });
  const env = process.env;
  const delayText = values['delay-ms'] ?? env.EMAIL_DELAY_MS ?? '5000';
  if (!/^-?\d+$/.test(delayText)) {
    throw new Error(`delay must be an integer number of milliseconds, not ${JSON.stringify(delayText)}`);
  }
  return {
    databaseUrl: values['database-url'] ?? env.PRODUCER_DATABASE_URL
      ?? 'postgres://postgres@127.0.0.1:5432/shop',
    orderId: values['order-id'] ?? env.ORDER_ID ?? String(Date.now()),
    to: values.to ?? env.EMAIL_TO ?? 'alice@example.com',
    delayMs: Number.parseInt(delayText, 10),
    rollback: values.rollback ?? false,
  };
}

// The email job: its key comes from the business data, so that enqueueing the same
// event twice yields one email.
function job(s) {
  return {
    key: `order-${s.orderId}:order_confirmation`,
    from: 'Shop <noreply@shop.example>',
    to: [s.to],
    subject: `Order ${s.orderId} confirmed`,
    text: 'Hello from the Node.js outbox example.',
  };
}

async function main() {
  const s = settings();
  const body = job(s);
  // Deadlines: on the connection and on every statement.
  const client = new Client({
    connectionString: s.databaseUrl,
    connectionTimeoutMillis: 10_000,
    statement_timeout: 10_000,
  });
  await client.connect();
  try {
    await client.query(ORDERS_TABLE);
    await client.query('BEGIN');
    let outboxId;
    try {
      await client.query('INSERT INTO example_orders (id, email) VALUES ($1, $2)', [s.orderId, s.to]);
      // Same transaction: the job is visible to the relay only after COMMIT.
      const { rows } = await client.query(
        'SELECT postie.enqueue($1::jsonb, make_interval(secs => $2::bigint / 1000.0)) AS id',
        [JSON.stringify(body), Math.max(s.delayMs, 0)],
      );
      outboxId = rows[0].id;
    } catch (err) {
      await client.query('ROLLBACK');
      throw err;
    }
    if (s.rollback) {
      await client.query('ROLLBACK');
      console.log(`rolled back key=${body.key}`);
    } else {
      await client.query('COMMIT');
      console.log(`enqueued key=${body.key} outbox_id=${outboxId} delay_ms=${s.delayMs}`);
    }
  } finally {
    await client.end();
  }
}

main().catch((err) => {
  console.error(`outbox: ${err.message}`);
  process.exit(1);
});
