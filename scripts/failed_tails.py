#!/usr/bin/env python3
"""Prints the end of each failed test's output from a ctest run.

    scripts/failed_tails.py BUILD_DIR [LINES]

ctest --output-on-failure prints a failed test's output where the test
ends, among the others' progress lines; a log cut to its head and tail (as
a CI page shows it) may lose it. This prints, after the run, the last LINES
(60) lines of every failed test's output, from BUILD_DIR's
Testing/Temporary/LastTest.log: where a test's failure is said.
"""
import os
import re
import sys


def outputs(log):
    """Test name -> its output lines, from ctest's LastTest.log."""
    out, name, lines = {}, None, None
    for line in log.splitlines():
        m = re.match(r"^\d+/\d+ Test: (.+)$", line)
        if m:
            name, lines = m.group(1), None
        elif name and line == "Output:":
            lines = []
        elif name and lines is not None and line == "<end of output>":
            out[name] = lines[1:]  # the ruler after "Output:"
            name, lines = None, None
        elif lines is not None:
            lines.append(line)
    return out


def main():
    build = sys.argv[1]
    keep = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    tmp = os.path.join(build, "Testing", "Temporary")
    failed_path = os.path.join(tmp, "LastTestsFailed.log")
    if not os.path.exists(failed_path):
        return
    failed = [line.split(":", 1)[1] for line in open(failed_path).read().splitlines() if ":" in line]
    got = outputs(open(os.path.join(tmp, "LastTest.log"), errors="replace").read())
    for name in failed:
        lines = got.get(name)
        print(f"== failed: {name}: the last {keep} lines of its output")
        print("\n".join(lines[-keep:]) if lines is not None else "(its output is not in LastTest.log)")


if __name__ == "__main__":
    main()
