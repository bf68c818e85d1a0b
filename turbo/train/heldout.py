"""The held-out evaluation: accepted per round on prompts the training never drew, stopped at
end of text as a user's generation stops, at the trained block and at 2, 4 and 8.

The drafter is measured the way it will run: filed into a copy of the install by the real
repack path and driven by the engine, every speculative generation checked against plain
decoding (a mismatch is a bug, reported as `lossless: false`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import turbo

from ..errors import TurboError
from ..repack import repack

BLOCKS = (2, 4, 8)


def blocks_for(trained: int | None) -> list[int]:
    """2, 4, 8 and the trained block; a DFlash drafter takes no block past the one it trained."""
    if trained is None:
        return list(BLOCKS)
    return sorted({b for b in BLOCKS if b <= trained} | {trained})


def measure(install_path: Path, drafter: str, prompts: dict[str, list[list[int]]], blocks: list[int],
            max_new_tokens: int, backend: str) -> dict:
    """Per group and block: accepted per round (and its parts), over every prompt."""

    rt = turbo.open(install_path, backend=backend)
    result: dict = {"drafter": drafter, "max_new_tokens": max_new_tokens, "stop_at_eos": True, "groups": {}}
    lossless = True
    for name, group in prompts.items():
        plain = [rt.generate(p, max_new_tokens=max_new_tokens, policy="off").tokens for p in group]
        rows = {}
        for block in blocks:
            accepted = rounds = tokens = 0
            for p, want in zip(group, plain):
                r = rt.generate(p, max_new_tokens=max_new_tokens, policy="fixed", block=block, drafter=drafter)
                lossless &= r.tokens == want
                accepted, rounds, tokens = accepted + r.stats.accepted, rounds + r.stats.rounds, tokens + len(r.tokens)
            rows[str(block)] = {"accepted_per_round": round(accepted / max(rounds, 1), 3), "rounds": rounds,
                                "generated_tokens": tokens}
        result["groups"][name] = {"prompts": len(group), "blocks": rows}
    result["lossless"] = lossless
    return result


def evaluate(install_path: Path, out: Path, kind: str, prompts: dict[str, list[list[int]]], blocks: list[int],
             max_new_tokens: int, backend: str, trained: Path | None) -> dict:
    """Measure the drafter in `trained` (None: the install's own) and write out/eval.json."""

    drafter = "mtp" if kind == "mtp" else "dflash"
    if trained is None:
        result = measure(install_path, drafter, prompts, blocks, max_new_tokens, backend)
    else:
        with tempfile.TemporaryDirectory(prefix="turbo-train-eval-") as tmp:
            filed = repack(install_path, Path(tmp) / "install", quiet=True,
                           **({"mtp_head": trained} if kind == "mtp" else {"drafter": trained}))
            result = measure(filed, drafter, prompts, blocks, max_new_tokens, backend)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def table(result: dict) -> str:
    """The evaluation as lines to print: one per group, accepted per round per block."""
    groups = result["groups"]
    if not groups:
        raise TurboError("no held-out prompts to evaluate on")
    blocks = list(next(iter(groups.values()))["blocks"])
    lines = [f"held-out, accepted per round (stopped at end of text, up to {result['max_new_tokens']} tokens): "
             + " / ".join(f"block {b}" for b in blocks)]
    for name, g in groups.items():
        lines.append(f"  {name} ({g['prompts']} prompts): "
                     + " / ".join(f"{g['blocks'][b]['accepted_per_round']:.2f}" for b in blocks))
    lines.append(f"  lossless: {'yes' if result['lossless'] else 'NO (a speculative generation differed from plain)'}")
    return "\n".join(lines)
