#!/usr/bin/env python3
"""Consume postie's delivery events (see "Delivery events" in the README): a queue
bound to the topic exchange "<prefix>.events", each event acknowledged after it was
handled, duplicates (delivery is at least once) skipped by the event's id.

    pip install -r examples/python/requirements.txt
    python3 examples/python/events.py --binding 'email.dead.*'

Every setting is a flag, or else an environment variable, or else a default:

    --amqp-url  AMQP_URL        amqp://guest:guest@127.0.0.1:5672/%2f
    --prefix    POSTIE_PREFIX   postie   (binds to exchange "<prefix>.events")
    --queue     EVENTS_QUEUE    none: a temporary queue "producer.events-<pid>-<ms>",
                                deleted with the connection; a name: a durable quorum
                                queue that keeps events while this consumer is down
    --binding   EVENTS_BINDING  email.#  (every event; "email.<outcome>.<type>")
    --count     EVENTS_COUNT    0        (run until stopped; more: exit after that
                                          many distinct events)

It prints "listening queue=<q> exchange=<x> binding=<b>" once bound, then one line
per event, "event id=<id> outcome=<o> key=<k> type=<t> routing_key=<r>".
"""

import argparse
import collections
import json
import os
import sys
import time

import pika

# How many event ids are remembered for dedupe (a real consumer keeps them with its
# own data, e.g. a unique column).
REMEMBERED = 100_000


def parse_args():
    env = os.environ.get
    p = argparse.ArgumentParser(description="Consume postie's delivery events.")
    p.add_argument("--amqp-url", default=env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"))
    p.add_argument("--prefix", default=env("POSTIE_PREFIX", "postie"))
    p.add_argument("--queue", default=env("EVENTS_QUEUE") or None)
    p.add_argument("--binding", default=env("EVENTS_BINDING", "email.#"))
    p.add_argument("--count", type=int, default=int(env("EVENTS_COUNT", "0")))
    return p.parse_args()


def main():
    args = parse_args()
    exchange = f"{args.prefix}.events"
    connection = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
    channel = connection.channel()
    if args.queue:
        queue = args.queue
        channel.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
    else:
        queue = f"producer.events-{os.getpid()}-{int(time.time() * 1000)}"
        channel.queue_declare(queue, exclusive=True, auto_delete=True)
    channel.queue_bind(queue, exchange, routing_key=args.binding)
    channel.basic_qos(prefetch_count=100)
    print(f"listening queue={queue} exchange={exchange} binding={args.binding}", flush=True)

    seen = collections.OrderedDict()  # event id -> None, oldest first
    handled = 0
    for method, _properties, body in channel.consume(queue):
        event = json.loads(body)
        if event["id"] not in seen:
            seen[event["id"]] = None
            if len(seen) > REMEMBERED:
                seen.popitem(last=False)
            print(
                f"event id={event['id']} outcome={event['outcome']} key={event['key']} "
                f"type={event['type'] or 'none'} routing_key={method.routing_key}",
                flush=True,
            )
            handled += 1
        # Acked after it was handled: a crash before this gets it again.
        channel.basic_ack(method.delivery_tag)
        if args.count and handled >= args.count:
            break
    channel.cancel()
    connection.close()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
    except Exception as e:  # one clear line, no traceback, for a command-line tool
        print(f"events failed: {type(e).__name__}: {str(e) or repr(e)}", file=sys.stderr)
        sys.exit(1)
