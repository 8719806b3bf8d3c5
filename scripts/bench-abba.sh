#!/usr/bin/env bash
# Before and after, back to back: builds release binaries of two revisions of postie
# and runs the send-path and delayed-path end-to-end benchmark with each in the order
# A, B, B, A, so that the machine's drift (±20 % over minutes here) hits both sides
# alike. `make bench-abba BASE=<rev> [HEAD=<rev>]` runs it; docs/benchmarks.md says how
# to read it.
#
#   scripts/bench-abba.sh BASE [HEAD]     (HEAD defaults to HEAD)
#
# Each side is `git archive`d into $TMPDIR/postie-abba/src-<commit> and built there with
# `cargo build --release --locked --bin postie` into this checkout's target directory
# (the dependencies are built once for both sides and the benchmark); its binary is
# copied to target/abba/<A|B>/postie (the benchmark finds postie's CPU time by that
# name). The benchmark itself is this checkout's `tests/bench.rs`, `bench_paths`, as a
# release test binary: per side one round of the legs (broker, database, SMTP, relay;
# the relay leg runs that side's postie) and the runs with 1 and 3 processes on each
# path, with POSTIE_BENCH_BIN naming the side's binary. Prints, per run and per side
# (the mean of its two runs): emails/s, ÷ the bound from the legs measured just before,
# and CPU ms per email of postie, PostgreSQL and RabbitMQ. Everything is kept in
# target/abba/ (runs-*.json, abba.md).
#
# Environment: POSTIE_BENCH_N (jobs per run, default 20,000; 500 checks the script),
# POSTIE_BENCH_POSTIE_ENV (settings for both sides' processes), CARGO, POSTIE_ABBA_REUSE
# (set: a side whose binary was built for the same commit before is not built again).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

usage() { echo "usage: $0 BASE [HEAD]   (git revisions; HEAD defaults to HEAD)" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
case "$1" in -h | --help) usage ;; esac
say() { printf 'bench-abba: %s\n' "$*" >&2; }

cargo=${CARGO:-cargo}
base=$(git rev-parse --verify --quiet "$1^{commit}") || { say "not a revision: $1"; exit 2; }
head=$(git rev-parse --verify --quiet "${2:-HEAD}^{commit}") || { say "not a revision: ${2:-HEAD}"; exit 2; }
target=$("$cargo" metadata --format-version 1 --no-deps \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
work="$target/abba"
mkdir -p "$work/A" "$work/B"

# The sources live outside the target directory: cargo records a source file under
# the target directory by its path relative to it, so a second tree there would be
# checked against the first tree's files.
sources="${TMPDIR:-/tmp}/postie-abba"
build() { # side commit
    local side=$1 commit=$2 src="$sources/src-$2"
    if [ -n "${POSTIE_ABBA_REUSE:-}" ] && [ -x "$work/$side/postie" ] && [ "$(cat "$work/$side/commit" 2>/dev/null)" = "$commit" ]; then
        say "reusing $side = ${commit:0:12} (POSTIE_ABBA_REUSE)"
        return
    fi
    if [ ! -f "$src/Cargo.toml" ]; then
        mkdir -p "$src"
        git archive "$commit" | tar -x -C "$src"
    fi
    say "building $side = ${commit:0:12} ($(git log -1 --format=%s "$commit" | cut -c1-60))"
    # Both sides build into one target directory, where cargo gives the two source
    # trees the same unit hashes and judges freshness by modification times. `git
    # archive` dates every file at its commit, so a side committed before the other
    # side's build could be taken as up to date and get the other side's binary.
    # Dated now, each side's sources are newer than anything built before them.
    find "$src" -type f -exec touch {} +
    (cd "$src" && CARGO_TARGET_DIR="$target" "$cargo" build --release --locked --bin postie)
    cp "$target/release/postie" "$work/$side/postie"
    echo "$commit" > "$work/$side/commit"
}
build A "$base"
if [ "$head" = "$base" ]; then
    cp "$work/A/postie" "$work/B/postie"
    echo "$head" > "$work/B/commit"
else
    build B "$head"
    if cmp -s "$work/A/postie" "$work/B/postie"; then
        say "A and B are the same binary: the two revisions compile to the same code, or B was not rebuilt"
        exit 1
    fi
fi

say "building the benchmark (tests/bench.rs of this checkout)"
bench=$("$cargo" test --release --locked --test bench --no-run --message-format=json \
    | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "bench" and m.get("executable"):
        print(m["executable"])')
[ -x "$bench" ] || { say "no benchmark executable from cargo"; exit 1; }

rm -f "$work"/runs-*.json
i=0
for side in A B B A; do
    i=$((i + 1))
    say "run $i of 4: $side (N = ${POSTIE_BENCH_N:-20000})"
    POSTIE_BENCH_BIN="$work/$side/postie" POSTIE_BENCH_OUT="$work/runs-$i-$side.json" \
        "$bench" --ignored --exact bench_paths --nocapture --test-threads=1
done

python3 - "$work" "$base" "$head" <<'PY' | tee "$work/abba.md"
import glob, json, os, sys
work, base, head = sys.argv[1:4]
files = sorted(glob.glob(os.path.join(work, "runs-*.json")))
runs = [(os.path.basename(f)[:-5].split("-")[2], json.load(open(f))) for f in files]
first = runs[0][1]
print(f"### postie A/B, ABBA: A = {base[:12]}, B = {head[:12]}, N = {first['n']} per run")
print()
print(f"{first['cores']} cores ({first['cpu_model']}); {first['versions']}.")
print()
cols = "emails/s | ÷ bound | postie ms | PostgreSQL ms | RabbitMQ ms"
def cells(r):
    c = r["cpu_ms_per_email"]
    return (r["per_s"], r["ratio_to_its_bound"], c["postie"], c["postgres"], c["rabbitmq"])
fmt = lambda v: f"{v[0]:.0f} | {v[1]:.2f} | {v[2]:.3f} | {v[3]:.3f} | {v[4]:.3f}"
print("| order | side | run | " + cols + " | stolen |")
print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
for i, (side, report) in enumerate(runs, 1):
    for r in report["runs"]:
        print(f"| {i} | {side} | {r['label']} | {fmt(cells(r))} | {report['stolen'] * 100:.0f} % |")
print()
print("Per side, the mean of its runs (CPU: ms per email):")
print()
print("| run | side | " + cols + " |")
print("|---|---|---:|---:|---:|---:|---:|")
for k, r0 in enumerate(first["runs"]):
    for side in ("A", "B"):
        values = [cells(rep["runs"][k]) for s, rep in runs if s == side]
        mean = tuple(sum(v[j] for v in values) / len(values) for j in range(5))
        print(f"| {r0['label']} | {side} | {fmt(mean)} |")
PY
say "kept in $work (abba.md, runs-*.json)"
