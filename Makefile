# postie — common tasks. `make help` lists them.
CARGO ?= cargo

.PHONY: help build test test-rabbitmq-4 demo fmt lint check ci bench bench-lanes bench-transports bench-checks bench-abba bench-delay chaos bench-console console-screenshots model

help: ## this list
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-15s %s\n", $$1, $$2}'

build: ## release build of postie (the tests build the SMTP sink, tests/smtp-sink, themselves)
	$(CARGO) build --release --locked

test: ## the whole test suite; first installs/starts what it needs (scripts/test-setup.sh)
	bash scripts/test-setup.sh
	$(CARGO) test --locked --workspace --all-targets --no-fail-fast

test-rabbitmq-4: ## the whole test suite against RabbitMQ 4.3 (Debian's, debootstrapped by scripts/rabbitmq-4.sh, ports 5673/15673); the same cargo command as make test, so nothing is built twice
	bash scripts/test-setup.sh
	bash scripts/rabbitmq-4.sh start
	set -a && eval "$$(bash scripts/rabbitmq-4.sh env)" && $(CARGO) test --locked --workspace --all-targets --no-fail-fast

demo: ## migrate, serve, publish a few jobs (one delayed), show the delivered emails
	bash scripts/demo.sh

fmt: ## format the code
	$(CARGO) fmt --all

lint: ## formatting and clippy, warnings are errors
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

check: lint test ## what CI checks

ci: ## what CI runs (.ci/run): make lint, then scripts/test-setup.sh, make test and make test-rabbitmq-4
	bash .ci/run

bench: ## throughput: end to end (1 and 3 processes), each leg's ceiling, CPU/email, ladder backlog (target/bench/)
	$(CARGO) test --release --locked --test bench -- --ignored --nocapture bench_full

bench-lanes: ## the send path with lanes off and on (half the jobs bulk), A B B A: emails/s, postie CPU/email (POSTIE_BENCH_N, default 10,000)
	$(CARGO) test --release --locked --test lanes -- --ignored --nocapture bench_lanes_on_and_off

bench-transports: ## each transport (smtp, ses, sendgrid, postmark, mailgun) against its test server, one run: emails/s, CPU/email (target/bench/transports.json)
	$(CARGO) test --release --locked --test bench_transports -- --ignored --nocapture bench_transports

bench-checks: ## SMTP with and without the suppression check and the events' row, A B C C B A twice: each one's cost (target/bench/checks.json)
	$(CARGO) test --release --locked --test bench_transports -- --ignored --nocapture bench_checks

bench-console: ## each console page timed over HTTP with 10^5 pending jobs and 10^4 dead letters (tests/bench_console.rs)
	$(CARGO) test --release --locked --test bench_console -- --ignored --nocapture bench_console_pages

console-screenshots: ## the console in headless Chromium (tests/console_browser.rs), a screenshot of each page into docs/console/
	POSTIE_CONSOLE_SCREENSHOTS=$(CURDIR)/docs/console $(CARGO) test --locked --test console_browser

bench-abba: ## before and after, back to back: BASE=<rev> [HEAD=<rev>], send and delayed paths run A B B A (target/abba/abba.md)
	@test -n "$(BASE)" || { echo "usage: make bench-abba BASE=<rev> [HEAD=<rev>]"; exit 2; }
	bash scripts/bench-abba.sh $(BASE) $(HEAD)

bench-delay: ## producer publish rates; ladder lateness for a 10,000-job burst over 0-60 s; 10^6 pending: parking time, broker memory, lateness behind them
	$(CARGO) test --release --locked --test bench_delay -- --ignored --nocapture delay_bench_full

chaos: ## fault-injection run: 10,000 jobs, 20 faults of each kind (POSTIE_CHAOS_SEED repeats a run)
	$(CARGO) test --locked --test chaos -- --ignored --nocapture chaos_full

model: ## the protocol's model (tests/model): exhaustive checks, then a random simulation of a larger configuration (POSTIE_MODEL_SECONDS, default 60); states, time, properties
	$(CARGO) test --locked -p postie-model --test check -- --include-ignored --nocapture --test-threads 1
