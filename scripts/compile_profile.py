#!/usr/bin/env python3
"""Where a cold test run's kernel compile time goes.

Reads the log that WGPU_ATTENTION_COMPILE_LOG=FILE makes the library write (src/pipelines.rs: one
line per pipeline built: kernel, hash of its source and constants, milliseconds, the process's
arguments) and prints, for a run on an empty shader cache:

- per kernel: the distinct specialisations, the time of each one's first build (what a driver's
  shader cache cannot save) and of the later builds (cache hits and in-process rebuilds);
- per test: the time of the specialisations it built first, and how many of them no other test
  builds (the ones that coverage must justify).

Usage: scripts/compile_profile.py FILE [--top N]

    MESA_SHADER_CACHE_DIR=$(mktemp -d) WGPU_ATTENTION_COMPILE_LOG=/tmp/compile.log \\
      cargo nextest run --profile ci --locked
    scripts/compile_profile.py /tmp/compile.log
"""
import argparse
import collections
import re


def test_name(args):
    m = re.search(r"--exact (\S+)", args)
    return m.group(1) if m else (args.strip() or "(no arguments)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    rows = []
    with open(a.log) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 4:
                rows.append((parts[0], parts[1], float(parts[2]), test_name(parts[3])))
    first = {}  # hash -> (kernel, ms, test): the first build of each specialisation
    later = collections.Counter()
    users = collections.defaultdict(set)
    for kernel, h, ms, test in rows:
        users[h].add(test)
        if h in first:
            later[kernel] += ms
        else:
            first[h] = (kernel, ms, test)
    total_first = sum(ms for _, ms, _ in first.values())
    total_later = sum(later.values())
    print(f"{len(rows)} builds, {len(first)} distinct specialisations: "
          f"first builds {total_first / 1e3:.1f} s, later builds {total_later / 1e3:.1f} s")

    per_kernel = collections.defaultdict(lambda: [0, 0.0])
    for kernel, ms, _ in first.values():
        per_kernel[kernel][0] += 1
        per_kernel[kernel][1] += ms
    print("\nkernel                 distinct  first s   later s")
    for k, (n, ms) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1]):
        print(f"{k:<22} {n:>8} {ms / 1e3:>8.1f} {later[k] / 1e3:>9.1f}")

    per_test = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
    for h, (kernel, ms, test) in first.items():
        t = per_test[test]
        t[0] += 1
        t[1] += ms
        if len(users[h]) == 1:
            t[2] += 1
            t[3] += ms
    print(f"\ntop {a.top} tests by first builds      first  s  (only this test: n, s)")
    for test, (n, ms, n1, ms1) in sorted(per_test.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{test[:44]:<44} {n:>4} {ms / 1e3:>7.1f}   {n1:>4} {ms1 / 1e3:>7.1f}")

    print(f"\ntop {a.top} specialisations")
    for h, (kernel, ms, test) in sorted(first.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{ms / 1e3:>7.2f} s  {kernel:<16} {h}  first in {test} (used by {len(users[h])} tests)")


if __name__ == "__main__":
    main()
