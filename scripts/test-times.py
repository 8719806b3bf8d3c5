#!/usr/bin/env python3
"""Per-test wall times of the last cargo-nextest run of each profile (issue 46).

Reads target/nextest/<profile>/junit.xml (written by every `make test`,
`make test-slow` and their RabbitMQ 4.3 forms; .config/nextest.toml) and prints, per
profile, the number of tests, their summed time and the slowest ones, as a Markdown
table (docs/benchmarks.md keeps one). Usage:

    scripts/test-times.py [--top N] [junit.xml ...]
"""
import argparse
import glob
import os
import sys
import xml.etree.ElementTree as ET

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--top", type=int, default=20, help="how many of the slowest to list")
parser.add_argument("files", nargs="*", help="JUnit files (default: target/nextest/*/junit.xml)")
args = parser.parse_args()

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
files = args.files or sorted(glob.glob(os.path.join(root, "target/nextest/*/junit.xml")))
if not files:
    sys.exit("no JUnit file: run `make test` (or make test-slow) first")

for path in files:
    tree = ET.parse(path)
    cases = []
    failed = 0
    for case in tree.iter("testcase"):
        binary = case.get("classname", "")
        name = case.get("name", "")
        seconds = float(case.get("time", "0"))
        bad = case.find("failure") is not None or case.find("error") is not None
        failed += bad
        cases.append((seconds, binary, name, bad))
    cases.sort(reverse=True)
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
