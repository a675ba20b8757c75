"""The table of cuda/bench/sweep.sh: GB/s per geometry and case, and whether every binary's
results equal the base binary's (--base LABEL; default the first binary's CHECK lines).
Usage: python3 sweep_table.py sweep.txt [--base LABEL]"""

from __future__ import annotations

import math
import sys
from collections import defaultdict

def main(path: str, base: str | None = None) -> int:
    times: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    checks: dict[tuple[str, str, str], dict[str, list[str]]] = defaultdict(dict)
    for line in open(path):
        f = line.split()
        if f[:1] == ["TIME"]:
            _, variant, dtype, numel, what, _ms, gbps = f
            key = variant if what.startswith("pass") else what
            times[(dtype, numel)][f"{key} {what}" if what.startswith("pass") else key] = float(gbps)
        elif f[:1] == ["CHECK"]:
            _, variant, dtype, numel, case, *vals = f
            checks[(dtype, numel, case)][variant] = vals
            base = base or variant
    for (dtype, numel), row in sorted(times.items(), key=lambda kv: (int(kv[0][1]), kv[0][0])):
        print(f"\n{dtype} {int(numel) / 1e6:g}M  (GB/s; pass = read + write, pass_read = read only)")
        for k, v in sorted(row.items(), key=lambda kv: -kv[1]):
            print(f"  {k:24s} {v:8.0f}")
    bad = 0
    for (dtype, numel, case), by in sorted(checks.items()):
        if base not in by:
            continue
        ref = by[base]
        for variant, vals in by.items():
            same = vals[:4] == ref[:4]
            s, r = float(vals[4].split("=")[1]), float(ref[4].split("=")[1])
            close = s == r or (math.isnan(s) and math.isnan(r)) or abs(s - r) <= 1e-6 * abs(r)
            if not (same and close):
                bad += 1
                print(f"MISMATCH {variant} {dtype} {numel} {case}: {vals} vs {base} {ref}")
    print(f"\nchecks: {sum(len(v) for v in checks.values())} results, {bad} differ from {base}")
    return 1 if bad else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    base_arg = args[args.index("--base") + 1] if "--base" in args else None
    sys.exit(main(args[0], base_arg))
