# postie — common tasks. `make help` lists them.
CARGO ?= cargo
# The SMTP and provider test servers, built by the same cargo command as the tests
# (built first: the tests' build does not make other members' binaries): each test
# process takes them from here instead of asking cargo for them, once per test.
TARGET_DIR ?= $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)
TEST_SERVERS = POSTIE_SMTP_SINK=$(TARGET_DIR)/debug/postie-smtp-sink POSTIE_PROVIDER_SERVER=$(TARGET_DIR)/debug/postie-provider-server
NEXTEST = $(CARGO) build --locked -q -p postie-smtp-sink -p postie-provider-server && $(TEST_SERVERS) $(CARGO) nextest run --locked --workspace --all-targets

.PHONY: help build test test-slow test-rabbitmq-4 test-slow-rabbitmq-4 test-times demo fmt lint check ci bench bench-lanes bench-transports bench-checks bench-unsubscribe bench-attachments bench-abba bench-delay chaos bench-console console-screenshots model

help: ## this list
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-15s %s\n", $$1, $$2}'

build: ## release build of postie (make test builds the SMTP sink, tests/smtp-sink, with the tests)
	$(CARGO) build --release --locked

test: ## the fast tier: every behaviour at the smallest size that proves it, in parallel (cargo-nextest; .config/nextest.toml); first installs/starts what it needs (scripts/test-setup.sh)
	bash scripts/test-setup.sh
	$(NEXTEST)

test-slow: ## the slow tier: full-size twins (slow_*), node-loss clusters, then the service restarts and the chaos smoke alone
	bash scripts/test-setup.sh
	$(NEXTEST) --profile slow; slow=$$?; $(NEXTEST) --profile alone && exit $$slow

test-rabbitmq-4: ## the fast tier against RabbitMQ 4.3 (Debian's, debootstrapped by scripts/rabbitmq-4.sh, ports 5673/15673); nothing is built twice
	bash scripts/test-setup.sh
	bash scripts/rabbitmq-4.sh start
	set -a && eval "$$(bash scripts/rabbitmq-4.sh env)" && $(NEXTEST)

test-slow-rabbitmq-4: ## the slow tier against RabbitMQ 4.3 (what CI runs: the broker users deploy)
	bash scripts/test-setup.sh
	bash scripts/rabbitmq-4.sh start
	set -a && eval "$$(bash scripts/rabbitmq-4.sh env)" && set +a \
	  && { $(NEXTEST) --profile slow; slow=$$?; $(NEXTEST) --profile alone && exit $$slow; }

test-times: ## per-test wall times of the last run of each profile (target/nextest/*/junit.xml), slowest first (docs/benchmarks.md)
	python3 scripts/test-times.py

demo: ## migrate, serve, publish a few jobs (one delayed), show the delivered emails
	bash scripts/demo.sh

fmt: ## format the code
	$(CARGO) fmt --all

lint: ## formatting and clippy, warnings are errors
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

check: lint test ## what CI checks

ci: ## what CI runs (.ci/run): make lint, the fast tier on RabbitMQ 3.10 and 4.3, the slow tier on 4.3
	bash .ci/run

bench: ## throughput: end to end (1 and 3 processes), each leg's ceiling, CPU/email, ladder backlog (target/bench/)
	$(CARGO) test --release --locked --test bench -- --ignored --nocapture bench_full

bench-lanes: ## the send path with lanes off and on (half the jobs bulk), A B B A: emails/s, postie CPU/email (POSTIE_BENCH_N, default 10,000)
	$(CARGO) test --release --locked --test lanes -- --ignored --nocapture bench_lanes_on_and_off

bench-transports: ## each transport (smtp, ses, sendgrid, postmark, mailgun) against its test server, one run: emails/s, CPU/email (target/bench/transports.json)
	$(CARGO) test --release --locked --test bench_transports -- --ignored --nocapture bench_transports

bench-checks: ## SMTP with and without the suppression check and the events' row, A B C C B A twice: each one's cost (target/bench/checks.json)
	$(CARGO) test --release --locked --test bench_transports -- --ignored --nocapture bench_checks

bench-unsubscribe: ## SMTP with one-click unsubscribe's headers off and on, A B B A twice: emails/s, CPU/email (target/bench/unsubscribe.json)
	$(CARGO) test --release --locked --test bench_transports -- --ignored --nocapture bench_unsubscribe

bench-attachments: ## emails with a 1 MB and a 20 MB attachment through SMTP and SES, A B B A each: emails/s, postie CPU/email, peak RSS (POSTIE_BENCH_N, default 200)
	$(CARGO) test --release --locked --test attachments -- --ignored --nocapture bench_attachments

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
