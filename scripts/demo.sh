#!/usr/bin/env bash
# The newcomer's tour: against RabbitMQ and PostgreSQL on 127.0.0.1, create a demo
# database, run `postie serve` with the .eml file transport (no mail server needed),
# publish a few jobs (one of them twice, one delayed by a few seconds), and show what
# was delivered, and that the delayed one arrived after its due time.
set -euo pipefail
cd "$(dirname "$0")/.."

export POSTIE__DATABASE__URL=${POSTIE__DATABASE__URL:-postgres://postgres@127.0.0.1:5432/postie_demo}
export POSTIE__TRANSPORT__URL=${POSTIE__TRANSPORT__URL:-file://$PWD/target/demo-mail}
export POSTIE__TRANSPORT__DEFAULT_FROM=${POSTIE__TRANSPORT__DEFAULT_FROM:-"Demo Shop <noreply@shop.example>"}
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

delay=5
delayed_key="$run:review_request"
echo "== postie publish --delay ${delay}s (x-delay: due $delay s after it is published)"
published_ms=$(date +%s%3N)
$postie publish --delay "${delay}s" --order-id "$run" --type review_request --to carol@example.com \
    --subject "How was order #$run?" --text "Tell us in a few words."

# postie publish stamps its own publish time on the job (a moment after published_ms);
# `postie pending` (ladder mode) shows the due time postie fixed from it.
due_ms=$((published_ms + delay * 1000))
for _ in $(seq 20); do
    due=$($postie pending --key "$delayed_key" | awk -v k="$delayed_key" '$NF == k {print $1}' || true)
    [ -n "$due" ] && break
    sleep 0.25
done
if [ -n "$due" ]; then
    echo "== postie pending --key $delayed_key"
    $postie pending --key "$delayed_key" || true
    due_ms=$(date -d "$due" +%s%3N)
fi

# Three emails at once, and the delayed one about $delay s later.
for _ in $(seq 120); do
    [ "$(ls target/demo-mail | wc -l)" -ge 4 ] && break
    sleep 0.5
done
sleep 1
echo "== postie status"; $postie status
echo "== delivered emails (target/demo-mail)"
ls -1 target/demo-mail
first=$(grep -l "^Subject: Your order #$run" target/demo-mail/*.eml | head -n1)
echo "== $first"
cat "$first"
echo

at() { date -u -d "@$(awk -v ms="$1" 'BEGIN {printf "%.3f", ms / 1000}')" +%H:%M:%S.%3N; }
echo "== the delayed job ($delayed_key, x-delay ${delay}s)"
delayed=$(grep -l "^Subject: How was order #$run?" target/demo-mail/*.eml | head -n1 || true)
# When it arrived: postie logs "sent" once the .eml file is written (the file's mtime
# is only as fine as the kernel's clock tick).
sent=$(grep -F "key=\"$delayed_key\"" target/demo-serve.log | grep -F 'outcome="sent"' | head -n1 | cut -d' ' -f1)
if [ -z "$delayed" ] || [ -z "$sent" ]; then
    echo "it has not arrived within 60 s: see target/demo-serve.log"
    exit 1
fi
arrived_ms=$(date -d "$sent" +%s%3N)
echo "published  $(at $((due_ms - delay * 1000))) UTC"
echo "due        $(at "$due_ms") UTC  (published + ${delay}s)"
echo "arrived    $(at "$arrived_ms") UTC  ($(awk -v ms=$((arrived_ms - due_ms)) 'BEGIN {printf "%.3f", ms / 1000}') s after its due time): $delayed"
echo "== serve log (target/demo-serve.log)"
tail -n 8 target/demo-serve.log
