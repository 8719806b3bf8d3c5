#!/usr/bin/env python3
"""Per-test wall times of the last cargo-nextest run of each profile (issue 46).

Reads target/nextest/<profile>/junit.xml (written by every `make test`,
`make test-slow` and their RabbitMQ 4.3 forms; .config/nextest.toml) and prints, per
profile, the number of tests, their summed time and the slowest ones, as a Markdown
table (docs/benchmarks.md keeps one). Usage:

    scripts/test-times.py [--top N] [junit.xml ...]
    scripts/test-times.py --compare LABEL=DIR [LABEL=DIR ...]

--compare prints one table of the whole suite: every test of every profile found
under each DIR (a copy of target/nextest from a run of `make test` and
`make test-slow` on one broker), its tier and its seconds under each LABEL, slowest
first (docs/test-times.md is one).
"""
import argparse
import glob
import os
import sys
import xml.etree.ElementTree as ET

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--top", type=int, default=20, help="how many of the slowest to list")
parser.add_argument("files", nargs="*", help="JUnit files (default: target/nextest/*/junit.xml)")
parser.add_argument("--compare", nargs="+", metavar="LABEL=DIR",
                    help="one whole-suite table, a column per LABEL")
args = parser.parse_args()

TIERS = {"default": "fast", "slow": "slow", "alone": "slow (alone)"}


def cases_of(tree):
    """(seconds, binary, name, failed) of each test case in a parsed JUnit file."""
    for case in tree.iter("testcase"):
        bad = case.find("failure") is not None or case.find("error") is not None
        yield float(case.get("time", "0")), case.get("classname", ""), case.get("name", ""), bad


if args.compare:
    labels, times, tiers = [], {}, {}
    for spec in args.compare:
        label, _, directory = spec.partition("=")
        labels.append(label)
        for profile, tier in TIERS.items():
            path = os.path.join(directory, profile, "junit.xml")
            if not os.path.exists(path):
                sys.exit(f"{path}: missing (run that tier on that broker first)")
            for seconds, binary, name, bad in cases_of(ET.parse(path)):
                test = f"{binary}::{name}"
                tiers[test] = tier
                times.setdefault(test, {})[label] = (seconds, bad)
    rows = sorted(times, key=lambda t: -max(s for s, _ in times[t].values()))
    print("| # | test | tier | " + " | ".join(f"{l} (s)" for l in labels) + " |")
    print("|---|------|------|" + "|".join("-----:" for _ in labels) + "|")
    for i, test in enumerate(rows, 1):
        cells = []
        for label in labels:
            seconds, bad = times[test].get(label, (None, False))
            cells.append("–" if seconds is None else f"{seconds:.1f}" + (" (failed)" if bad else ""))
        print(f"| {i} | `{test}` | {tiers[test]} | " + " | ".join(cells) + " |")
    for label in labels:
        summed = sum(times[t][label][0] for t in times if label in times[t])
        print(f"\n{label}: {sum(label in times[t] for t in times)} tests, summed {summed:.0f} s")
    sys.exit(0)

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
files = args.files or sorted(glob.glob(os.path.join(root, "target/nextest/*/junit.xml")))
if not files:
    sys.exit("no JUnit file: run `make test` (or make test-slow) first")

for path in files:
    tree = ET.parse(path)
    cases = sorted(cases_of(tree), reverse=True)
    failed = sum(c[3] for c in cases)
    suites = tree.getroot()
    print(f"## {path}")
    print()
    print(f"{len(cases)} tests, {failed} failed, summed {sum(c[0] for c in cases):.0f} s "
          f"(run's wall time: {float(suites.get('time', '0')):.0f} s)")
    print()
    print("| # | test | seconds |")
    print("|---|------|--------:|")
    for i, (seconds, binary, name, bad) in enumerate(cases[: args.top], 1):
        mark = " (failed)" if bad else ""
        print(f"| {i} | `{binary}::{name}`{mark} | {seconds:.1f} |")
    print()
