"""What the open layout's check costs at open (turbo/store/layout_file.py `check`): the stat fast path,
the full check of a first open after a change (the weights' digest and the CRC-32 pass, also
timed alone), and turbo.open, each in this process, the page cache warm.

    python -m scripts.bench_layout_check INSTALL [--reps 3] [--threads 2]

INSTALL's .packed.verified is removed for the full checks (and written again by them).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import turbo
import turbo.engine  # noqa: F401 (imported before timing: the open is timed, not the imports)
from turbo.store import layout_file
from turbo.store.install import safetensors_files
from turbo.store.safetensors_format import read_header


def timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("install")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    root = Path(args.install)
    weights, packed = safetensors_files(root), root / layout_file.PACKED_FILE
    verified = root / layout_file.VERIFIED_FILE
    layout_file.check(root, weights)  # (warm: the page cache, the record)
    rows = {"check, unchanged (stat)": [], "check, after a change (full)": [], "digest of the weights": [],
            "CRC-32 pass of the layout": [], "turbo.open": []}
    for _ in range(args.reps):
        rows["check, unchanged (stat)"].append(timed(lambda: layout_file.check(root, weights)))
        verified.unlink(missing_ok=True)
        rows["check, after a change (full)"].append(timed(lambda: layout_file.check(root, weights)))
        rows["digest of the weights"].append(timed(lambda: layout_file.digest(weights)))
        rows["CRC-32 pass of the layout"].append(timed(lambda: layout_file.segment_crcs(packed, read_header(packed))))
        rows["turbo.open"].append(timed(lambda: turbo.open(str(root), threads=args.threads)))
    size = lambda files: sum(p.stat().st_size for p in files) / 2**20  # noqa: E731
    print(f"{root}: weights {size(weights):.0f} MiB, layout {size([packed]):.0f} MiB")
    for name, xs in rows.items():
        xs.sort()
        print(f"  {name:<30} median {xs[len(xs) // 2]:.3f} s [{xs[0]:.3f}, {xs[-1]:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
