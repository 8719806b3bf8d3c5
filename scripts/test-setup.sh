#!/usr/bin/env bash
# What the test suite needs on this machine, put in place when missing: the tools of
# the example and security tests, PostgreSQL and RabbitMQ running, and the RabbitMQ
# plugins the tests use. `make test` runs it first, and so does CI (.ci/run).
#
# Idempotent. Prints one line per thing it installs, starts or enables, nothing when
# all is in place (then it takes under a second). When it cannot do something
# (not root, no package registry) it stops with an error that names what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'test-setup: %s\n' "$*"; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT
die() { # message; shows the last lines of the failed command's output, if any
    printf 'test-setup: error: %s\n' "$*" >&2
    if [ -s "$log" ]; then sed 's/^/    /' "$log" | tail -n 15 >&2; fi
    exit 1
}
root() { [ "$(id -u)" = 0 ]; }

wait_for() { # what, seconds, command...
    local what=$1 seconds=$2; shift 2
    local deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] || die "$what did not come up within ${seconds}s"
        sleep 0.5
    done
}

# --- Tools --------------------------------------------------------------------------
# cargo-nextest runs the tiers (.config/nextest.toml): one process per test, in
# parallel. The machine's image carries it; building it here would cost CI minutes.
if ! cargo nextest --version >/dev/null 2>&1; then
    die "cargo-nextest is missing (make test runs the suite with it): cargo install cargo-nextest --locked, or a release binary from https://nexte.st"
fi
# Debian's packages: socat and openssl (TLS in front of the broker, tests/security.rs),
# Go with Debian's amqp091-go and pgx v4 (the Go producer example is built in GOPATH
# mode against them, without the module proxy), and libfaketime (instances with a
# wrong clock, tests/gray_clock.rs).
apt_missing=()
command -v socat >/dev/null || apt_missing+=(socat)
command -v openssl >/dev/null || apt_missing+=(openssl)
command -v go >/dev/null || apt_missing+=(golang-go)
[ -d /usr/share/gocode/src/github.com/rabbitmq/amqp091-go ] \
    || apt_missing+=(golang-github-rabbitmq-amqp091-go-dev)
[ -d /usr/share/gocode/src/github.com/jackc/pgx/v4 ] \
    || apt_missing+=(golang-github-jackc-pgx-v4-dev)
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || apt_missing+=(faketime)
command -v chromium >/dev/null || apt_missing+=(chromium)
command -v chromedriver >/dev/null || apt_missing+=(chromium-driver)
if [ ${#apt_missing[@]} -gt 0 ]; then
    root || die "installing ${apt_missing[*]} needs root (apt-get); run as root or install them"
    command -v apt-get >/dev/null || die "no apt-get to install ${apt_missing[*]}; install them"
    apt-get update -qq >"$log" 2>&1 \
        || die "apt-get update failed; Debian's package registry is needed for ${apt_missing[*]}"
    # apt-get update only warns when it cannot reach the registry.
    unreachable=""
    if grep -q '^W: Failed to fetch' "$log"; then
        unreachable=": apt-get update could not reach Debian's package registry"
    fi
    for package in "${apt_missing[@]}"; do say "installing $package (apt-get)"; done
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${apt_missing[@]}" >"$log" 2>&1 \
        || die "apt-get install ${apt_missing[*]} failed$unreachable"
fi

# Python: pika and psycopg (the Python producer examples) and PyYAML
# (tests/deploy_files.rs).
command -v python3 >/dev/null || die "python3 is missing (the Python example and the deploy file tests need it)"
pip_args=()
if ! python3 -c 'import pika, psycopg' 2>/dev/null; then
    say "installing pika and psycopg (pip install -r examples/python/requirements.txt)"
    pip_args+=(-r examples/python/requirements.txt)
fi
if ! python3 -c 'import yaml' 2>/dev/null; then
    say "installing PyYAML (pip install pyyaml)"
    pip_args+=(pyyaml)
fi
# moto in server mode: the S3-compatible store of the attachment tests
# (tests/support/moto.rs).
if ! command -v moto_server >/dev/null; then
    say "installing moto's S3 server (pip install 'moto[server]')"
    pip_args+=('moto[server]')
fi
if [ ${#pip_args[@]} -gt 0 ]; then
    # A Python whose packages belong to the OS (PEP 668) refuses a plain pip install.
    if python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
        pip_args+=(--break-system-packages)
    fi
    python3 -m pip install -q --disable-pip-version-check "${pip_args[@]}" >"$log" 2>&1 \
        || die "pip install failed (is PyPI reachable? may this user write to $(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')?)"
fi

# Node.js: the Node producer examples' dependencies (amqplib, pg), from the lock file.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    die "node or npm is missing (the Node producer example needs both)"
fi
if ! (cd examples/node && node -e "require('amqplib'); require('pg')") >/dev/null 2>&1; then
    [ -w examples/node ] || die "npm ci needs to write examples/node, which this user cannot"
    say "installing the Node example's dependencies (npm ci --prefix examples/node)"
    npm ci --prefix examples/node --no-audit --no-fund --loglevel=error >"$log" 2>&1 \
        || die "npm ci --prefix examples/node failed (is the npm registry reachable?)"
fi

# --- PostgreSQL (127.0.0.1:5432, user postgres, trust) -------------------------------
if ! pg_isready -h 127.0.0.1 -p 5432 -q; then
    root || die "PostgreSQL is not running on 127.0.0.1:5432, and starting it needs root"
    say "starting PostgreSQL"
    # A cluster that is already starting says so and fails: the wait below decides.
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start \
        >"$log" 2>&1 || true
    wait_for PostgreSQL 60 pg_isready -h 127.0.0.1 -p 5432 -q
fi
: >"$log"
psql -h 127.0.0.1 -U postgres -d postgres -Atc 'SELECT 1' >/dev/null 2>"$log" \
    || die "PostgreSQL runs, but user postgres cannot log in on 127.0.0.1:5432 without a password"

# --- RabbitMQ (127.0.0.1:5672, guest/guest) ------------------------------------------
plugins=(rabbitmq_management rabbitmq_shovel rabbitmq_shovel_management)
amqp_port_open() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }
plugins_enabled() { # quick: the shovel management API answers
    if command -v curl >/dev/null; then
        curl -sf -o /dev/null -m 5 -u guest:guest http://127.0.0.1:15672/api/shovels
    else
        rabbitmq-plugins -q is_enabled "${plugins[@]}"
    fi
}
if ! plugins_enabled >/dev/null 2>&1; then
    if ! rabbitmq-diagnostics -q check_running >/dev/null 2>&1; then
        root || die "RabbitMQ is not running on 127.0.0.1:5672, and starting it needs root"
        say "starting RabbitMQ"
        rabbitmq-server -detached >"$log" 2>&1 || true
        wait_for RabbitMQ 120 rabbitmq-diagnostics -q check_running
    fi
    if ! plugins_enabled >/dev/null 2>&1; then
        say "enabling RabbitMQ plugins ${plugins[*]}"
        rabbitmq-plugins enable "${plugins[@]}" >"$log" 2>&1 \
            || die "rabbitmq-plugins enable ${plugins[*]} failed"
        wait_for "RabbitMQ's management API" 60 plugins_enabled
    fi
    wait_for "RabbitMQ's AMQP port" 60 amqp_port_open
fi
