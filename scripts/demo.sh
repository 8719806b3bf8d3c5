#!/usr/bin/env bash
# The newcomer's tour: against RabbitMQ and PostgreSQL on 127.0.0.1, create a demo
# database, run `postie serve` with the .eml file transport (no mail server needed),
# publish a few jobs (one of them twice), and show what was delivered.
set -euo pipefail
cd "$(dirname "$0")/.."

export POSTIE__DATABASE__URL=${POSTIE__DATABASE__URL:-postgres://postgres@127.0.0.1:5432/postie_demo}
export POSTIE__SMTP__URL=${POSTIE__SMTP__URL:-file://$PWD/target/demo-mail}
export POSTIE__SMTP__DEFAULT_FROM=${POSTIE__SMTP__DEFAULT_FROM:-"Demo Shop <noreply@shop.example>"}
export POSTIE__TOPOLOGY__PREFIX=${POSTIE__TOPOLOGY__PREFIX:-postie-demo}
export POSTIE__HTTP__LISTEN=${POSTIE__HTTP__LISTEN:-}

cargo build --quiet --locked --bin postie
postie=target/debug/postie

psql -h 127.0.0.1 -U postgres -d postgres -qAtc "SELECT 1 FROM pg_database WHERE datname = 'postie_demo'" | grep -q 1 \
    || psql -h 127.0.0.1 -U postgres -d postgres -qc "CREATE DATABASE postie_demo"
rm -rf target/demo-mail && mkdir -p target/demo-mail

echo "== postie migrate"; $postie migrate
echo "== postie topology"; $postie topology
echo "== postie serve (background)"
$postie serve 2> target/demo-serve.log &
serve=$!
trap 'kill -TERM $serve 2>/dev/null; wait $serve 2>/dev/null || true' EXIT
sleep 1

run=$(date +%s)
echo "== postie publish (order $run twice: the second is a duplicate)"
$postie publish --order-id "$run" --type order_confirmation --to alice@example.com \
    --subject "Your order #$run" --text "Thanks for your order." --html "<p>Thanks for your order.</p>"
$postie publish --order-id "$run" --type order_confirmation --to alice@example.com \
    --subject "Your order #$run" --text "Thanks for your order."
$postie publish --order-id "$run" --type shipped --to alice@example.com \
    --subject "Order #$run has shipped" --text "It is on its way."
$postie publish --file - <<JSON
{"key": "welcome:$run", "to": ["bob@example.com"], "subject": "Welcome, Bob", "text": "Hello Bob!", "headers": {"X-Campaign": "demo"}}
JSON

for _ in $(seq 30); do
    [ "$(ls target/demo-mail | wc -l)" -ge 3 ] && break
    sleep 0.5
done
sleep 1
echo "== postie status"; $postie status
echo "== delivered emails (target/demo-mail)"
ls -1 target/demo-mail
first=$(ls target/demo-mail/*.eml | head -n1)
echo "== $first"
cat "$first"
echo
echo "== serve log (target/demo-serve.log)"
tail -n 8 target/demo-serve.log
