#!/usr/bin/env python3
"""Publish one email job to postie (see "The message contract" in the README).

    pip install -r examples/python/requirements.txt
    python3 examples/python/publish.py --to alice@example.com --delay-ms 10000

Every setting is a flag, or else an environment variable, or else a default:

    --amqp-url  AMQP_URL        amqp://guest:guest@127.0.0.1:5672/%2f
    --prefix    POSTIE_PREFIX   postie   (publishes to exchange "<prefix>.delayed")
    --key       EMAIL_KEY       demo-<unix ms>:welcome
    --to        EMAIL_TO        alice@example.com
    --delay-ms  EMAIL_DELAY_MS  5000     (0 = send now)

On success it prints one line, "published key=<key> exchange=<x> delay_ms=<n>",
once the broker has confirmed the job. Any failure exits non-zero.
"""

import argparse
import json
import os
import sys
import time

import pika

ROUTING_KEY = "email"


def parse_args():
    env = os.environ.get
    p = argparse.ArgumentParser(description="Publish one email job to postie.")
    p.add_argument("--amqp-url", default=env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"))
    p.add_argument("--prefix", default=env("POSTIE_PREFIX", "postie"))
    # In a real service the key comes from your business data, e.g.
    # f"order-{order.id}:order_confirmation", so that publishing the same event
    # twice (a retry, a redelivery) collides and yields one email. The time-based
    # default below only lets this example run repeatedly.
    p.add_argument("--key", default=env("EMAIL_KEY") or f"demo-{int(time.time() * 1000)}:welcome")
    p.add_argument("--to", default=env("EMAIL_TO", "alice@example.com"))
    p.add_argument("--delay-ms", type=int, default=int(env("EMAIL_DELAY_MS", "5000")))
    return p.parse_args()


def main():
    args = parse_args()
    exchange = f"{args.prefix}.delayed"
    body = {
        "key": args.key,
        "from": "Shop <noreply@shop.example>",
        "to": [args.to],
        "subject": "Welcome!",
        "text": "Hello from the Python producer example.",
        "html": "<p>Hello from the <b>Python</b> producer example.</p>",
    }
    properties = pika.BasicProperties(
        delivery_mode=2,  # persistent
        content_type="application/json",
        headers={
            # Integers: pika sends them as AMQP integers, as the contract asks.
            "x-delay": max(args.delay_ms, 0),
            # The due time counts from here, even if postie is down right now.
            "postie-published-at": int(time.time() * 1000),
        },
    )

    connection = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
    try:
        channel = connection.channel()
        # Publisher confirms: basic_publish returns only once the broker has the job,
        # and raises (pika.exceptions.NackError) if it refused it.
        channel.confirm_delivery()
        # No mandatory flag: the delayed-message plugin returns every delayed publish
        # as unroutable yet delivers it later.
        channel.basic_publish(
            exchange=exchange,
            routing_key=ROUTING_KEY,
            body=json.dumps(body).encode("utf-8"),
            properties=properties,
        )
    finally:
        connection.close()
    print(f"published key={args.key} exchange={exchange} delay_ms={args.delay_ms}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # one clear line, no traceback, for a command-line tool
        print(f"publish failed: {type(e).__name__}: {str(e) or repr(e)}", file=sys.stderr)
        sys.exit(1)
