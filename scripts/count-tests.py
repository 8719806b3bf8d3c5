#!/usr/bin/env python3
"""Counts the suite's tests and assertions by reading the source (issue 46: the tiers
must not prove less). A test is a function under #[test], #[tokio::test(...)] or a
proptest! block's `fn`; an assertion is a use of assert!, assert_eq!, assert_ne!,
debug_assert*!, prop_assert*! or a panic! in a test file. Ignored tests (benchmarks)
are counted apart. Usage: scripts/count-tests.py [repo root] (default: this repo).
Prints one line per kind and the totals."""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
files = [p for p in root.rglob("*.rs") if "target" not in p.parts and ".git" not in p.parts]
test_attr = re.compile(r"#\[(?:tokio::)?test\b[^\]]*\]")
ignore_attr = re.compile(r"#\[ignore\b")
assertion = re.compile(r"\b(?:debug_)?(?:prop_)?assert(?:_eq|_ne)?!|\bpanic!")
proptest_fn = re.compile(r"proptest!\s*\{")
tests = ignored = asserts = 0
for path in files:
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if test_attr.search(line):
            # An #[ignore] among the attributes right above or below the test attribute.
            window = "\n".join(lines[max(0, i - 3): i + 4])
            if ignore_attr.search(window):
                ignored += 1
            else:
                tests += 1
    # proptest! { ... fn name(...) ... }: each fn inside is a test.
    for m in proptest_fn.finditer(text):
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        tests += len(re.findall(r"\n\s*fn\s+\w+\s*\(", text[m.end():j]))
    in_tests = "tests" in path.parts or "#[cfg(test)]" in text
    if in_tests:
        body = text if "tests" in path.parts else text[text.index("#[cfg(test)]"):]
        asserts += len(assertion.findall(body))
print(f"tests (not ignored): {tests}")
print(f"ignored (benchmarks, browser): {ignored}")
print(f"assertions in test code: {asserts}")
