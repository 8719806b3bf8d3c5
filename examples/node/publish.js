#!/usr/bin/env node
// Publish one email job to postie (see "The message contract" in the README).
//
//   npm ci --prefix examples/node
//   node examples/node/publish.js --to alice@example.com --delay-ms 10000
//
// Every setting is a flag, or else an environment variable, or else a default:
//
//   --amqp-url  AMQP_URL        amqp://guest:guest@127.0.0.1:5672/%2f
//   --prefix    POSTIE_PREFIX   postie   (publishes to exchange "<prefix>.delayed")
//   --key       EMAIL_KEY       demo-<unix ms>:welcome
//   --to        EMAIL_TO        alice@example.com
//   --delay-ms  EMAIL_DELAY_MS  5000     (0 = send now)
//
// On success it prints one line, "published key=<key> exchange=<x> delay_ms=<n>",
// once the broker has confirmed the job. Any failure exits non-zero.
'use strict';

const { parseArgs } = require('node:util');
const amqp = require('amqplib');

const ROUTING_KEY = 'email';

function settings() {
  const { values } = parseArgs({
    options: {
      'amqp-url': { type: 'string' },
      prefix: { type: 'string' },
      key: { type: 'string' },
      to: { type: 'string' },
      'delay-ms': { type: 'string' },
    },
  });
  const env = process.env;
  const delayText = values['delay-ms'] ?? env.EMAIL_DELAY_MS ?? '5000';
  if (!/^-?\d+$/.test(delayText)) {
    throw new Error(`delay must be an integer number of milliseconds, not ${JSON.stringify(delayText)}`);
  }
  return {
    amqpUrl: values['amqp-url'] ?? env.AMQP_URL ?? 'amqp://guest:guest@127.0.0.1:5672/%2f',
    prefix: values.prefix ?? env.POSTIE_PREFIX ?? 'postie',
    // In a real service the key comes from your business data, e.g.
    // `order-${order.id}:order_confirmation`, so that publishing the same event twice
    // (a retry, a redelivery) collides and yields one email. The time-based default
    // below only lets this example run repeatedly.
    key: values.key ?? env.EMAIL_KEY ?? `demo-${Date.now()}:welcome`,
    to: values.to ?? env.EMAIL_TO ?? 'alice@example.com',
    delayMs: Math.max(Number.parseInt(delayText, 10), 0),
  };
}

async function main() {
  const s = settings();
  const exchange = `${s.prefix}.delayed`;
  const body = {
    key: s.key,
    from: 'Shop <noreply@shop.example>',
    to: [s.to],
    subject: 'Welcome!',
    text: 'Hello from the Node.js producer example.',
    html: '<p>Hello from the <b>Node.js</b> producer example.</p>',
  };

  const connection = await amqp.connect(s.amqpUrl);
  // Without a listener, an 'error' event would crash the process with a stack trace;
  // the channel's own listeners below report what went wrong.
  connection.on('error', () => {});
  try {
    // A confirm channel: the broker acks (or nacks) every publish.
    const channel = await connection.createConfirmChannel();
    await new Promise((resolve, reject) => {
      // E.g. 404 when the exchange does not exist: the broker closes the channel.
      channel.on('error', reject);
      channel.on('close', () => reject(new Error('the channel closed before the broker confirmed')));
      channel.publish(
        exchange,
        ROUTING_KEY,
        Buffer.from(JSON.stringify(body)),
        {
          deliveryMode: 2, // persistent
          contentType: 'application/json',
          // No `mandatory`: the delayed-message plugin returns every delayed publish
          // as unroutable yet delivers it later.
          headers: {
            // Typed explicitly as AMQP 64-bit integers (amqplib would otherwise
            // pick the smallest integer type, which postie reads just as well).
            'x-delay': { '!': 'long', value: s.delayMs },
            // The due time counts from here, even if postie is down right now.
            'postie-published-at': { '!': 'long', value: Date.now() },
          },
        },
        (err) => (err ? reject(new Error('the broker nacked the publish')) : resolve()),
      );
    });
    await channel.close();
  } finally {
    await connection.close().catch(() => {});
  }
  console.log(`published key=${s.key} exchange=${exchange} delay_ms=${s.delayMs}`);
}

main().catch((err) => {
  console.error(`publish failed: ${err.message}`);
  process.exit(1);
});
