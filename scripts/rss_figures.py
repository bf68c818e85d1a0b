"""Peak RSS by what a generation uses (docs/hardening.md): memory figures, not timings.

    python -m scripts.rss_figures [--install tiny] [--positions 16777216]

Each figure is a fresh process's peak RSS (ru_maxrss) on the install with its context raised to
--positions (default RoPE: irrelevant to the forward): `max_new_tokens=16000000` up to its first
token, and greedy runs of 64 and 4,096 tokens. Beside them, the K/V bytes a cache reserved for
prompt + max_new_tokens up front would have taken.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = "def fib(n):"
RUN = """
import resource, sys, turbo
rt = turbo.open(sys.argv[1])
max_new, tokens = int(sys.argv[2]), int(sys.argv[3])
got = 0
for event in rt.stream({prompt!r}, max_new_tokens=max_new, stop_at_eos=False, policy="off"):
    got += len(event.tokens)
    if got >= tokens:
        break
print(got, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def long_context(install: Path, positions: int, into: Path) -> Path:
    """`install` with max_position_embeddings `positions`: every other file a link to its own."""
    for f in install.iterdir():
        (into / f.name).symlink_to(f.resolve())
    (into / "config.json").unlink()
    config = json.loads((install / "config.json").read_text()) | {"max_position_embeddings": positions}
    (into / "config.json").write_text(json.dumps(config))
    return into


def peak(install: Path, max_new: int, tokens: int) -> tuple[int, int]:
    """(tokens generated, peak RSS in MiB) of one fresh process."""
    out = subprocess.run([sys.executable, "-c", RUN.format(prompt=PROMPT), str(install), str(max_new), str(tokens)],
                         capture_output=True, text=True, check=True)
    got, kib = map(int, out.stdout.split())
    return got, kib // 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", default="tiny")
    parser.add_argument("--positions", type=int, default=2 ** 24)
    args = parser.parse_args(argv)
    import turbo
    from turbo.store.install import resolve

    base = resolve(args.install).resolve()
    with tempfile.TemporaryDirectory(prefix="turbo-rss-") as tmp:
        install = long_context(base, args.positions, Path(tmp))
        rt = turbo.open(str(install))
        a, prompt = rt.install.arch, len(rt.encode(PROMPT))
        per_position = 2 * len(a.full_layers) * a.num_kv_heads * a.head_dim * rt.trunk.kv_dtype.itemsize
        del rt
        runs = [("max_new_tokens=16000000, to its first token", 16_000_000, 1),
                ("64 tokens", 64, 64), ("4,096 tokens", 4096, 4096)]
        print(f"install {base.name}, max_position_embeddings {args.positions}, K/V {per_position} B a position")
        for what, max_new, tokens in runs:
            got, mib = peak(install, max_new, tokens)
            upfront = (prompt + max_new) * per_position / 2 ** 20
            print(f"{what:<45} {got:>5} tokens  peak RSS {mib:>6} MiB  (a cache for prompt + max_new_tokens: "
                  f"{upfront:,.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
