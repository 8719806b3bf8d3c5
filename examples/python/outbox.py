#!/usr/bin/env python3
"""Record an order and enqueue its confirmation email in one transaction, through
postie's transactional outbox (see "Transactional outbox" in the README).

    pip install -r examples/python/requirements.txt
    postie outbox install --database postgres://app@127.0.0.1/shop   # once
    python3 examples/python/outbox.py --to alice@example.com --delay-ms 10000

The order row and the email job commit together or not at all: postie's relay
(`outbox.sources` in `postie serve`) publishes the job after the commit, and the
inbox's key makes it one email. A job rolled back with the order is never sent.

Every setting is a flag, or else an environment variable, or else a default:

    --database-url  PRODUCER_DATABASE_URL  postgres://postgres@127.0.0.1:5432/shop
    --order-id      ORDER_ID               <unix ms>
    --to            EMAIL_TO               alice@example.com
    --delay-ms      EMAIL_DELAY_MS         5000     (0 = send now)
    --rollback                                      (roll the transaction back instead)

On success it prints "enqueued key=<key> outbox_id=<id> delay_ms=<n>" after the
commit, or with --rollback "rolled back key=<key>". Any failure exits non-zero: a
refused job (postie.enqueue checks the key and the recipients) rolls the order back
with it.
"""

import argparse
import json
import os
import time

import psycopg

# The shop's own table; in a real service this is your business data.
ORDERS_TABLE = """
CREATE TABLE IF NOT EXISTS example_orders (
    id         text PRIMARY KEY,
    email      text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)"""


def parse_args():
    env = os.environ.get
    p = argparse.ArgumentParser(description="Record an order and enqueue its email.")
    p.add_argument(
        "--database-url",
        default=env("PRODUCER_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/shop"),
    )
    p.add_argument("--order-id", default=env("ORDER_ID") or str(int(time.time() * 1000)))
    p.add_argument("--to", default=env("EMAIL_TO", "alice@example.com"))
    p.add_argument("--delay-ms", type=int, default=int(env("EMAIL_DELAY_MS", "5000")))
    p.add_argument("--rollback", action="store_true")
    return p.parse_args()


def job(args):
    """The email job: its key comes from the business data, so that enqueueing the
    same event twice yields one email."""
    return {
        "key": f"order-{args.order_id}:order_confirmation",
        "from": "Shop <noreply@shop.example>",
        "to": [args.to],
        "subject": f"Order {args.order_id} confirmed",
        "text": "Hello from the Python outbox example.",
    }


def main():
    args = parse_args()
    body = job(args)
    # connect_timeout bounds the connection; statement_timeout every statement.
    with psycopg.connect(args.database_url, connect_timeout=10,
                         options="-c statement_timeout=10000") as conn:
        with conn.cursor() as cur:
            cur.execute(ORDERS_TABLE)
        conn.commit()
        with conn.transaction(force_rollback=args.rollback):
            with conn.cursor() as cur:
                cur.execute(
                    "INSERT INTO example_orders (id, email) VALUES (%s, %s)",
                    (args.order_id, args.to),
                )
                # Same transaction: the job is visible to the relay only after COMMIT.
                cur.execute(
                    "SELECT postie.enqueue(%s::jsonb, make_interval(secs => %s / 1000.0))",
                    (json.dumps(body), max(args.delay_ms, 0)),
                )
                (outbox_id,) = cur.fetchone()
    if args.rollback:
        print(f"rolled back key={body['key']}", flush=True)
    else:
        print(f"enqueued key={body['key']} outbox_id={outbox_id} delay_ms={args.delay_ms}",
              flush=True)


if __name__ == "__main__":
    main()
