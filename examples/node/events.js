#!/usr/bin/env node
// Consume postie's delivery events (see "Delivery events" in the README): a queue
// bound to the topic exchange "<prefix>.events", each event acknowledged after it was
// handled, duplicates (delivery is at least once) skipped by the event's id.
//
//   npm ci --prefix examples/node
//   node examples/node/events.js --binding 'email.dead.*'
//
// Every setting is a flag, or else an environment variable, or else a default:
//
//   --amqp-url  AMQP_URL        amqp://guest:guest@127.0.0.1:5672/%2f
//   --prefix    POSTIE_PREFIX   postie   (binds to exchange "<prefix>.events")
//   --queue     EVENTS_QUEUE    none: a temporary queue "producer.events-<pid>-<ms>",
//                               deleted with the connection; a name: a durable quorum
//                               queue that keeps events while this consumer is down
//   --binding   EVENTS_BINDING  email.#  (every event; "email.<outcome>.<type>")
//   --count     EVENTS_COUNT    0        (run until stopped; more: exit after that
//                                         many distinct events)
//
// It prints "listening queue=<q> exchange=<x> binding=<b>" once bound, then one line
// per event, "event id=<id> outcome=<o> key=<k> type=<t> routing_key=<r>".
'use strict';

const { parseArgs } = require('node:util');
const amqp = require('amqplib');

// How many event ids are remembered for dedupe (a real consumer keeps them with its
// own data, e.g. a unique column).
const REMEMBERED = 100_000;

function settings() {
  const { values } = parseArgs({
    options: {
      'amqp-url': { type: 'string' },
      prefix: { type: 'string' },
      queue: { type: 'string' },
      binding: { type: 'string' },
      count: { type: 'string' },
    },
  });
  const env = process.env;
  const count = values.count ?? env.EVENTS_COUNT ?? '0';
  if (!/^\d+$/.test(count)) {
    throw new Error(`count must be a whole number, not ${JSON.stringify(count)}`);
  }
  return {
    amqpUrl: values['amqp-url'] ?? env.AMQP_URL ?? 'amqp://guest:guest@127.0.0.1:5672/%2f',
    prefix: values.prefix ?? env.POSTIE_PREFIX ?? 'postie',
    queue: values.queue ?? (env.EVENTS_QUEUE || null),
    binding: values.binding ?? env.EVENTS_BINDING ?? 'email.#',
    count: Number.parseInt(count, 10),
  };
}

async function main() {
  const s = settings();
  const exchange = `${s.prefix}.events`;
  const connection = await amqp.connect(s.amqpUrl);
  const channel = await connection.createChannel();
  let queue = s.queue;
  if (queue) {
    await channel.assertQueue(queue, { durable: true, arguments: { 'x-queue-type': 'quorum' } });
  } else {
    queue = `producer.events-${process.pid}-${Date.now()}`;
    await channel.assertQueue(queue, { exclusive: true, autoDelete: true, durable: false });
  }
  await channel.bindQueue(queue, exchange, s.binding);
  await channel.prefetch(100);
  const seen = new Set(); // insertion order: the oldest first
  let handled = 0;
  await new Promise((resolve, reject) => {
    connection.on('error', reject);
    channel.on('close', () => reject(new Error('the channel closed')));
    channel
      .consume(queue, (message) => {
        if (message === null) {
          reject(new Error('the broker cancelled the consumer'));
          return;
        }
        const event = JSON.parse(message.content.toString('utf8'));
        if (!seen.has(event.id)) {
          seen.add(event.id);
          if (seen.size > REMEMBERED) seen.delete(seen.values().next().value);
          console.log(
            `event id=${event.id} outcome=${event.outcome} key=${event.key} ` +
              `type=${event.type ?? 'none'} routing_key=${message.fields.routingKey}`,
          );
          handled += 1;
        }
        // Acked after it was handled: a crash before this gets it again.
        channel.ack(message);
        if (s.count && handled >= s.count) resolve();
      })
      .then(() => console.log(`listening queue=${queue} exchange=${exchange} binding=${s.binding}`), reject);
  });
  channel.removeAllListeners('close');
  await connection.close();
}

main().catch((error) => {
  console.error(`events failed: ${error.message}`);
  process.exit(1);
});
