#!/usr/bin/env bash
# RabbitMQ 4.3 beside the machine's own broker, for running the test suite against
# today's broker generation (`make test-rabbitmq-4`). No container registry exists
# here, so the broker comes from Debian's packages: `debootstrap` a minimal Debian of
# the suite that carries rabbitmq-server 4.3 into a folder of its own, and run the
# broker there (chroot) on its own ports and node name:
#
#   AMQP 127.0.0.1:5673, management 15673, distribution 25673, node rabbit43@localhost
#
# The machine's broker (5672, rabbit@localhost) is never touched; both share the
# machine's epmd. Usage:
#
#   scripts/rabbitmq-4.sh setup    # debootstrap the folder once (about a minute, 400 MB)
#   scripts/rabbitmq-4.sh start    # setup, then start the broker if it is not running
#   scripts/rabbitmq-4.sh stop     # stop it and unmount the folder's /proc and /dev
#   scripts/rabbitmq-4.sh ctl ...  # rabbitmqctl against it
#   scripts/rabbitmq-4.sh env      # the test suite's variables for it (KEY='value' lines)
#
# Needs root (debootstrap, chroot, mounts). Idempotent; prints a line per thing it does.
set -euo pipefail
cd "$(dirname "$0")/.."

ROOT=${POSTIE_RABBITMQ4_ROOT:-/var/lib/postie/rabbitmq-4}
SUITE=${POSTIE_RABBITMQ4_SUITE:-sid}
AMQP_PORT=5673
MANAGEMENT_PORT=15673
DIST_PORT=25673
NODE=rabbit43@localhost
HERE=$(pwd)

say() { printf 'rabbitmq-4: %s\n' "$*"; }
die() { printf 'rabbitmq-4: error: %s\n' "$*" >&2; exit 1; }
in_root() { chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/var/lib/rabbitmq "$@"; }
ctl() { in_root rabbitmqctl -n "$NODE" "$@"; }

# The Debian mirror this machine's apt uses (never spelled here: read from its sources).
mirror() {
    local uri
    uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)
    if [ -z "$uri" ]; then
        uri=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
            | awk '{print $2}' | grep -v security | head -n1 || true)
    fi
    [ -n "$uri" ] || die "no Debian mirror found in /etc/apt/sources.list*"
    printf '%s\n' "$uri"
}

setup() {
    [ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot)"
    if [ -x "$ROOT/usr/sbin/rabbitmq-server" ]; then
        return
    fi
    if ! command -v debootstrap >/dev/null; then
        say "installing debootstrap (apt-get)"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    fi
    say "debootstrapping Debian $SUITE with rabbitmq-server into $ROOT"
    rm -rf "$ROOT.partial"
    mkdir -p "$(dirname "$ROOT")"
    debootstrap --variant=minbase --include=rabbitmq-server "$SUITE" "$ROOT.partial" "$(mirror)" \
        >"$ROOT.log" 2>&1 || { tail -n 15 "$ROOT.log" >&2; die "debootstrap failed (log: $ROOT.log)"; }
    mv "$ROOT.partial" "$ROOT"
}

version() { chroot "$ROOT" dpkg-query -W -f '${Version}' rabbitmq-server; }

mount_system() {
    cp /etc/hosts "$ROOT/etc/hosts"
    mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
    mountpoint -q "$ROOT/dev" || mount --bind /dev "$ROOT/dev"
}

start() {
    setup
    mount_system
    if ctl -q status >/dev/null 2>&1; then
        return
    fi
    case "$(version)" in
        4.3*) ;;
        *) say "warning: $SUITE carries rabbitmq-server $(version), not 4.3.x" ;;
    esac
    mkdir -p "$ROOT/etc/rabbitmq"
    cat >"$ROOT/etc/rabbitmq/rabbitmq.conf" <<EOF
listeners.tcp.default = $AMQP_PORT
management.tcp.port = $MANAGEMENT_PORT
EOF
    cat >"$ROOT/etc/rabbitmq/rabbitmq-env.conf" <<EOF
NODENAME=$NODE
DIST_PORT=$DIST_PORT
EOF
    in_root rabbitmq-plugins --offline enable rabbitmq_management rabbitmq_shovel \
        rabbitmq_shovel_management >/dev/null
    say "starting RabbitMQ $(version) as $NODE on 127.0.0.1:$AMQP_PORT (management $MANAGEMENT_PORT)"
    in_root rabbitmq-server -detached >/dev/null 2>&1 || true
    local deadline=$((SECONDS + 120))
    until ctl -q await_startup --timeout 5 >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] || die "RabbitMQ 4 did not start within 120s (logs: $ROOT/var/log/rabbitmq)"
        sleep 1
    done
    until curl -sf -o /dev/null -m 5 -u guest:guest "http://127.0.0.1:$MANAGEMENT_PORT/api/overview"; do
        [ "$SECONDS" -lt "$deadline" ] || die "RabbitMQ 4's management API did not answer within 120s"
        sleep 1
    done
}

# Unmounts $1 if mounted, waiting up to 10 s for the stopped node's last processes
# (epmd, the shell) to let go of it.
unmount() {
    local tries=10
    while mountpoint -q "$1"; do
        umount "$1" 2>/dev/null && return 0
        tries=$((tries - 1))
        [ "$tries" -gt 0 ] || { umount "$1"; return; }
        sleep 1
    done
}

stop() {
    if [ -d "$ROOT" ]; then
        ctl -q stop >/dev/null 2>&1 || true
        unmount "$ROOT/proc"
        unmount "$ROOT/dev"
    fi
    return 0
}

case "${1:-}" in
    setup) setup ;;
    start) start ;;
    stop) stop ;;
    ctl) shift; ctl "$@" ;;
    env)
        printf "POSTIE_TEST_AMQP_URL='%s'\n" "amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f"
        printf "POSTIE_TEST_MANAGEMENT_URL='%s'\n" "http://127.0.0.1:$MANAGEMENT_PORT"
        printf "POSTIE_TEST_RABBITMQCTL='%s'\n" "$HERE/scripts/rabbitmq-4.sh ctl"
        printf "POSTIE_TEST_RABBITMQ_ROOT='%s'\n" "$ROOT"
        ;;
    *) die "usage: $0 setup|start|stop|ctl ARGS|env" ;;
esac
