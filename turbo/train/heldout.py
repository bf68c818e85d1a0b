"""The held-out evaluation: accepted per round on prompts the training never drew, stopped at
end of text as a user's generation stops, at the trained block and at 2, 4 and 8.

The drafter is measured the way it will run: filed into a copy of the install by the real
repack path and driven by the engine, every speculative generation checked against plain
decoding (a mismatch is a bug, reported as `lossless: false`).
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import turbo

from ..errors import TurboError
from ..repack import repack
from .data import Group, draw

BLOCKS = (2, 4, 8)
# --heldout-count unset: a tenth of each group's documents, 1 to AUTO_MOST; the training keeps more
# than it holds out, so a group of fewer than AUTO_FEWEST documents cannot hold one out
AUTO_MOST = 10
AUTO_FEWEST = 3


def split(groups: list[Group], count: int | None, seed: int) -> tuple[list[Group], list[Group]]:
    """(training groups, held-out groups): `count` documents of each group held out (None: a
    tenth, 1 to AUTO_MOST); refused when the training would not keep more than it holds out."""
    train, held = [], []
    for g in groups:
        n = len(g.documents)
        k = count if count is not None else min(AUTO_MOST, max(1, n // 10))
        if n <= 2 * k:
            need = (f"at least {AUTO_FEWEST} documents a group for a held-out evaluation" if count is None
                    else f"more than {2 * k} needed")
            raise TurboError(f"--data group {g.name!r}: {n} documents, too few to hold {k} out ({need}); "
                             "give --heldout FILE_OR_DIR, or --heldout-count 0")
        docs = list(g.documents)
        random.Random(f"heldout/{seed}/{g.name}").shuffle(docs)
        held.append(Group(g.name, docs[:k]))
        train.append(Group(g.name, docs[k:]))
    return train, held


def said(train: list[Group], held: list[Group]) -> str:
    """The split as one line."""
    parts = ", ".join(f"{h.name} {len(h.documents)} of {len(h.documents) + len(t.documents)}"
                      for t, h in zip(train, held))
    return f"held out for the evaluation: {parts} documents (--heldout-count N or --heldout FILE_OR_DIR to choose)"


def prompts_of(held: list[Group], prompt_tokens: int, seed: int) -> dict[str, list[list[int]]]:
    rng = random.Random(f"prompts/{seed}")
    return {g.name: [draw(doc, prompt_tokens, rng) for doc in g.documents] for g in held}


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
