#!/usr/bin/env node
// Publish one email job to postie, or many with pipelined publisher confirms (see
// "The message contract" and "Publishing many jobs" in the README).
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
//   --count     EMAIL_COUNT     1        (more: keys "<key>-0", "<key>-1", ...)
//   --window    EMAIL_WINDOW    256      (publishes awaiting their confirm, at most)
//
// On success it prints one line per job, "published key=<key> exchange=<x>
// delay_ms=<n>", once the broker has confirmed it; with --count above 1, then
// "published N jobs in S s (R jobs/s, window W)". Any failure (a nack, a closed
// channel, no confirm within 30 s) exits non-zero.
'use strict';

const { parseArgs } = require('node:util');
const amqp = require('amqplib');

const ROUTING_KEY = 'email';
// How long to wait for a confirm before giving up on the broker.
const CONFIRM_TIMEOUT_MS = 30_000;

function settings() {
  const { values } = parseArgs({
    options: {
      'amqp-url': { type: 'string' },
      prefix: { type: 'string' },
      key: { type: 'string' },
      to: { type: 'string' },
      'delay-ms': { type: 'string' },
      count: { type: 'string' },
      window: { type: 'string' },
    },
  });
  const env = process.env;
  const delayText = values['delay-ms'] ?? env.EMAIL_DELAY_MS ?? '5000';
  if (!/^-?\d+$/.test(delayText)) {
    throw new Error(`delay must be an integer number of milliseconds, not ${JSON.stringify(delayText)}`);
  }
  const atLeastOne = (name, text) => {
    if (!/^\d+$/.test(text) || Number.parseInt(text, 10) < 1) {
      throw new Error(`${name} must be a whole number of at least 1, not ${JSON.stringify(text)}`);
    }
    return Number.parseInt(text, 10);
  };
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
    count: atLeastOne('count', values.count ?? env.EMAIL_COUNT ?? '1'),
    window: atLeastOne('window', values.window ?? env.EMAIL_WINDOW ?? '256'),
  };
}

// The jobs' keys: the key alone, or `<key>-0` ... `<key>-<count - 1>`.
function keys(s) {
  if (s.count === 1) return [s.key];
  return Array.from({ length: s.count }, (_, i) => `${s.key}-${i}`);
}

// Publishes the jobs and calls confirmed(key) for each once the broker has confirmed
// it, in publishing order. It keeps at most s.window publishes unconfirmed: when the
// window is full it waits for the oldest confirm before publishing the next job. It
// rejects at the first nack or if the channel closes; jobs published but not
// confirmed then may or may not have arrived, and a real producer republishes them
// (the idempotency key makes that safe).
async function publish(s, confirmed) {
  const exchange = `${s.prefix}.delayed`;
  const connection = await amqp.connect(s.amqpUrl);
  // Without a listener, an 'error' event would crash the process with a stack trace;
  // the channel's own listeners below report what went wrong.
  connection.on('error', () => {});
  try {
    // A confirm channel: the broker acks (or nacks) every publish.
    const channel = await connection.createConfirmChannel();
    // Rejects once the channel fails, e.g. 404 when the exchange does not exist: the
    // broker closes the channel.
    let done = false;
    const failed = new Promise((_, reject) => {
      channel.on('error', reject);
      channel.on('close', () => {
        if (!done) reject(new Error('the channel closed before the broker confirmed'));
      });
    });
    failed.catch(() => {}); // awaited below, through Promise.race
    // Published, not yet confirmed: oldest first.
    const inFlight = [];
    const waitOldest = async () => {
      const { key, confirm } = inFlight.shift();
      let timer;
      const timeout = new Promise((_, reject) => {
        timer = setTimeout(() => reject(new Error(`no confirm for ${key} within 30 s`)), CONFIRM_TIMEOUT_MS);
      });
      try {
        await Promise.race([confirm, failed, timeout]);
      } finally {
        clearTimeout(timer);
      }
      confirmed(key);
    };
    for (const key of keys(s)) {
      if (inFlight.length >= s.window) await waitOldest();
      const body = {
        key,
        from: 'Shop <noreply@shop.example>',
        to: [s.to],
        subject: 'Welcome!',
        text: 'Hello from the Node.js producer example.',
        html: '<p>Hello from the <b>Node.js</b> producer example.</p>',
      };
      let flushed = true;
      const confirm = new Promise((resolve, reject) => {
        flushed = channel.publish(
          exchange,
          ROUTING_KEY,
          Buffer.from(JSON.stringify(body)),
          {
            deliveryMode: 2, // persistent
            contentType: 'application/json',
            // No `mandatory`: the delayed-message plugin returns every delayed
            // publish as unroutable yet delivers it later.
            headers: {
              // Typed explicitly as AMQP 64-bit integers (amqplib would otherwise
              // pick the smallest integer type, which postie reads just as well).
              'x-delay': { '!': 'long', value: s.delayMs },
              // The due time counts from here, even if postie is down right now.
              'postie-published-at': { '!': 'long', value: Date.now() },
            },
          },
          (err) => (err ? reject(new Error(`the broker nacked the publish of ${key}`)) : resolve()),
        );
      });
      confirm.catch(() => {}); // awaited in order, through waitOldest
      inFlight.push({ key, confirm });
      // The socket's buffer is full: let it drain before writing more.
      if (!flushed) await Promise.race([new Promise((resolve) => channel.once('drain', resolve)), failed]);
    }
    while (inFlight.length > 0) await waitOldest();
    done = true;
    await channel.close();
  } finally {
    await connection.close().catch(() => {});
  }
}

async function main() {
  const s = settings();
  const exchange = `${s.prefix}.delayed`;
  const started = process.hrtime.bigint();
  await publish(s, (key) => {
    console.log(`published key=${key} exchange=${exchange} delay_ms=${s.delayMs}`);
  });
  if (s.count > 1) {
    const seconds = Number(process.hrtime.bigint() - started) / 1e9;
    console.log(
      `published ${s.count} jobs in ${seconds.toFixed(2)} s ` +
        `(${(s.count / seconds).toFixed(0)} jobs/s, window ${s.window})`,
    );
  }
}

main().catch((err) => {
  console.error(`publish failed: ${err.message}`);
  process.exit(1);
});
