#!/usr/bin/env python3
"""Publish one email job to postie, or many with pipelined publisher confirms (see
"The message contract" and "Publishing many jobs" in the README).

    pip install -r examples/python/requirements.txt
    python3 examples/python/publish.py --to alice@example.com --delay-ms 10000

Every setting is a flag, or else an environment variable, or else a default:

    --amqp-url  AMQP_URL        amqp://guest:guest@127.0.0.1:5672/%2f
    --prefix    POSTIE_PREFIX   postie   (publishes to exchange "<prefix>.delayed")
    --key       EMAIL_KEY       demo-<unix ms>:welcome
    --to        EMAIL_TO        alice@example.com
    --delay-ms  EMAIL_DELAY_MS  5000     (0 = send now)
    --count     EMAIL_COUNT     1        (more: keys "<key>-0", "<key>-1", ...)
    --window    EMAIL_WINDOW    256      (publishes awaiting their confirm, at most)

On success it prints one line per job, "published key=<key> exchange=<x>
delay_ms=<n>", once the broker has confirmed it; with --count above 1, then
"published N jobs in S s (R jobs/s, window W)". Any failure (a nack, a closed
channel, and with --count above 1 no confirm within 30 s) exits non-zero.

One job uses pika's BlockingConnection, whose basic_publish waits for the confirm:
the simple way for one job per business event. Many jobs use pika's
SelectConnection, which lets confirms arrive while later jobs are published: the
way for bulk (imports, campaigns, backfills).
"""

import argparse
import collections
import json
import os
import sys
import time

import pika

ROUTING_KEY = "email"
# How long to wait for a confirm before giving up on the broker.
CONFIRM_TIMEOUT_S = 30


def parse_args():
    env = os.environ.get
    p = argparse.ArgumentParser(description="Publish email jobs to postie.")
    p.add_argument("--amqp-url", default=env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"))
    p.add_argument("--prefix", default=env("POSTIE_PREFIX", "postie"))
    # In a real service the key comes from your business data, e.g.
    # f"order-{order.id}:order_confirmation", so that publishing the same event
    # twice (a retry, a redelivery) collides and yields one email. The time-based
    # default below only lets this example run repeatedly.
    p.add_argument("--key", default=env("EMAIL_KEY") or f"demo-{int(time.time() * 1000)}:welcome")
    p.add_argument("--to", default=env("EMAIL_TO", "alice@example.com"))
    p.add_argument("--delay-ms", type=int, default=int(env("EMAIL_DELAY_MS", "5000")))
    p.add_argument("--count", type=at_least_one, default=env("EMAIL_COUNT", "1"))
    p.add_argument("--window", type=at_least_one, default=env("EMAIL_WINDOW", "256"))
    return p.parse_args()


def at_least_one(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return int(text)


def keys(args):
    """The jobs' keys: the key alone, or "<key>-0" ... "<key>-<count - 1>"."""
    if args.count == 1:
        return [args.key]
    return [f"{args.key}-{i}" for i in range(args.count)]


def job(key, args):
    """The body and properties of the job for key."""
    body = {
        "key": key,
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
    return json.dumps(body).encode("utf-8"), properties


def publish_one(args, exchange, key):
    """Publishes one job and returns once the broker has confirmed it."""
    body, properties = job(key, args)
    connection = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
    try:
        channel = connection.channel()
        # Publisher confirms: basic_publish returns only once the broker has the job,
        # and raises (pika.exceptions.NackError) if it refused it.
        channel.confirm_delivery()
        # No mandatory flag: the delayed-message plugin returns every delayed publish
        # as unroutable yet delivers it later.
        channel.basic_publish(
            exchange=exchange, routing_key=ROUTING_KEY, body=body, properties=properties
        )
    finally:
        connection.close()


def publish_many(args, exchange, all_keys, confirmed):
    """Publishes the jobs, keeping at most args.window of them unconfirmed, and calls
    confirmed(key) for each as the broker confirms it.

    Raises at the first nack or if the broker closes the channel or connection; jobs
    published but not confirmed then may or may not have arrived, and a real producer
    republishes them (the idempotency key makes that safe).
    """
    pending = collections.deque(all_keys)  # not yet published
    in_flight = collections.OrderedDict()  # delivery tag -> key, oldest first
    state = {"channel": None, "tag": 0, "error": None, "done": False, "timer": None}

    def watch():
        # Fails if no confirm arrives within CONFIRM_TIMEOUT_S while jobs await one.
        if state["timer"] is not None:
            connection.ioloop.remove_timeout(state["timer"])
            state["timer"] = None
        if in_flight:
            oldest = next(iter(in_flight.values()))
            state["timer"] = connection.ioloop.call_later(
                CONFIRM_TIMEOUT_S,
                lambda: fail(f"no confirm for {oldest} within {CONFIRM_TIMEOUT_S} s"),
            )

    def fail(message):
        if state["error"] is None:
            state["error"] = message
        if not (connection.is_closing or connection.is_closed):
            connection.close()

    def publish_more(channel):
        # Fill the window: each publish takes the channel's next delivery tag (1, 2, …).
        while pending and len(in_flight) < args.window:
            key = pending.popleft()
            body, properties = job(key, args)
            # No mandatory flag: the delayed-message plugin returns every delayed
            # publish as unroutable yet delivers it later.
            channel.basic_publish(exchange, ROUTING_KEY, body, properties)
            state["tag"] += 1
            in_flight[state["tag"]] = key
            if state["timer"] is None:
                watch()

    def on_confirm(frame):
        method = frame.method
        if isinstance(method, pika.spec.Basic.Nack):
            fail(f"the broker nacked the publish of {in_flight.get(method.delivery_tag)}")
            return
        # One ack may confirm every publish up to its tag ("multiple").
        if method.multiple:
            tags = [t for t in in_flight if t <= method.delivery_tag]
        else:
            tags = [method.delivery_tag]
        for tag in tags:
            confirmed(in_flight.pop(tag))
        watch()
        if pending:
            publish_more(state["channel"])
        elif not in_flight:
            state["done"] = True
            connection.close()

    def on_channel_open(channel):
        state["channel"] = channel
        channel.add_on_close_callback(on_channel_closed)
        # Publisher confirms: the broker acks (or nacks) every publish on this channel,
        # and on_confirm hears of it while later jobs are being published.
        channel.confirm_delivery(
            ack_nack_callback=on_confirm, callback=lambda _select_ok: publish_more(channel)
        )

    def on_channel_closed(_channel, reason):
        # E.g. 404 when the exchange does not exist: the broker closes the channel.
        if not state["done"]:
            fail(f"the channel closed before the broker confirmed: {reason}")

    def on_open_error(_connection, error):
        state["error"] = f"cannot connect: {str(error) or repr(error)}"
        connection.ioloop.stop()

    def on_closed(_connection, reason):
        if not state["done"] and state["error"] is None:
            state["error"] = f"the connection closed before the broker confirmed: {reason}"
        connection.ioloop.stop()

    connection = pika.SelectConnection(
        pika.URLParameters(args.amqp_url),
        on_open_callback=lambda c: c.channel(on_open_callback=on_channel_open),
        on_open_error_callback=on_open_error,
        on_close_callback=on_closed,
    )
    connection.ioloop.start()  # until on_closed or on_open_error stops it
    if state["error"] is not None:
        raise RuntimeError(state["error"])


def main():
    args = parse_args()
    exchange = f"{args.prefix}.delayed"

    def confirmed(key):
        print(f"published key={key} exchange={exchange} delay_ms={args.delay_ms}", flush=True)

    if args.count == 1:
        publish_one(args, exchange, args.key)
        confirmed(args.key)
        return
    started = time.monotonic()
    publish_many(args, exchange, keys(args), confirmed)
    seconds = time.monotonic() - started
    print(
        f"published {args.count} jobs in {seconds:.2f} s "
        f"({args.count / seconds:.0f} jobs/s, window {args.window})",
        flush=True,
    )


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # one clear line, no traceback, for a command-line tool
        print(f"publish failed: {type(e).__name__}: {str(e) or repr(e)}", file=sys.stderr)
        sys.exit(1)
