# syntax=docker/dockerfile:1
#
# postie container image.
#   docker build -t postie .
#   docker run --rm postie --help
# Configuration comes from POSTIE__SECTION__KEY environment variables (see README).

############################ build ############################
FROM rust:1-bookworm AS builder
WORKDIR /build

# 1. Dependencies only: build against stand-in sources so this layer is cached until
#    the manifests or Cargo.lock change. Cargo.toml is a workspace: every member's
#    manifest must be present for it (and --locked) to resolve, but only postie, the
#    default member, is built; the other members' sources are not needed, except an
#    empty lib.rs for the model, whose manifest names no target of its own
#    (tests/deploy_files.rs checks that every member is here).
COPY Cargo.toml Cargo.lock ./
COPY tests/smtp-sink/Cargo.toml tests/smtp-sink/Cargo.toml
COPY tests/provider-server/Cargo.toml tests/provider-server/Cargo.toml
COPY tests/model/Cargo.toml tests/model/Cargo.toml
RUN mkdir -p src tests/model/src \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs tests/model/src/lib.rs \
 && cargo build --release --locked --bin postie \
 && rm -rf src \
           target/release/postie target/release/postie.d \
           target/release/deps/postie-* target/release/deps/libpostie-* \
           target/release/.fingerprint/postie-*

# 2. The crate itself. sql/ is needed at compile time: src/inbox.rs embeds
#    sql/0001_inbox.sql with include_str!.
COPY src ./src
COPY sql ./sql
RUN touch src/main.rs src/lib.rs \
 && cargo build --release --locked --bin postie \
 && strip target/release/postie \
 && ./target/release/postie --version

############################ run ############################
FROM debian:bookworm-slim

# ca-certificates: amqps://, smtps:// and STARTTLS verify servers with the system roots.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 postie \
 && useradd --system --uid 10001 --gid postie --no-create-home \
            --home-dir /nonexistent --shell /usr/sbin/nologin postie

COPY --from=builder /build/target/release/postie /usr/local/bin/postie

ENV POSTIE__LOG__FORMAT=json \
    POSTIE__HTTP__LISTEN=0.0.0.0:9090

# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
# /metrics, /healthz, /readyz
EXPOSE 9090

# Liveness from /healthz without curl: bash's /dev/tcp speaks just enough HTTP/1.0 to
# read the status line. The port follows POSTIE__HTTP__LISTEN; with the listener
# disabled (empty) the check fails, so disable the healthcheck too in that case.
# This applies to `serve` only; override it (or use --no-healthcheck) when running
# one-shot commands such as `migrate`. Kubernetes ignores HEALTHCHECK: give it
# httpGet probes on /healthz (liveness) and /readyz (readiness) instead.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${POSTIE__HTTP__LISTEN##*:} && printf 'GET /healthz HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && read -r -t 4 status <&3 && [[ $status == HTTP/1.[01]\\ 200* ]]"]

# SIGTERM (Docker's default stop signal) makes `serve` drain in-flight jobs: give it
# a stop timeout above transport.timeout (docker stop -t / stop_grace_period).
ENTRYPOINT ["postie"]
CMD ["serve"]
