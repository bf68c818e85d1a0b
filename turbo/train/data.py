"""The training set: the user's text read into documents (`read_groups`), prompts drawn from them
(`draw`), and the install's trunk run over them (`build`, self-distillation) into `Example`s that
`batch` stacks. --data, --targets and what an example holds: README, "Training a drafter".
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..backends.ops import rms_norm
from ..errors import TurboError


@dataclass
class Group:
    name: str
    documents: list[list[int]]  # token ids, each non-empty


@dataclass
class Example:
    ids: torch.Tensor  # [T] int64: prompt then continuation (or a text window)
    first: int  # the first position whose next token is a target (the prompt's last token; 0 for text)
    aux: torch.Tensor | None  # [T, n_aux * H] fp16: the target layers' outputs (DFlash)
    hidden: torch.Tensor | None  # [T, H] fp16: the last layer's output after the final norm (MTP)
    greedy: torch.Tensor | None  # [T] int64: the trunk's argmax at each position (MTP)


# What one data path (a file, or a directory's files) may hold: it is read and tokenized whole, so
# a larger one is refused before any byte is read (split it, or pass a sample of it).
MAX_GROUP_BYTES = 1 << 30


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _documents(path: Path) -> list[str]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return [d for f in files for d in _documents(f)]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TurboError(f"{path}: not UTF-8 text (expected text, or .jsonl of documents)") from None
    if path.suffix != ".jsonl":
        return [text]
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise TurboError(f"{path}:{n}: not a JSON line (expected a string or an object with a 'text' field)") \
                from None
        doc = item.get("text") if isinstance(item, dict) else item
        if not isinstance(doc, str):
            raise TurboError(f"{path}:{n}: expected a JSON string or an object with a 'text' string")
        docs.append(doc)
    return docs


def read_groups(paths: list[str], encode) -> list[Group]:
    """One group per path, its documents tokenized by `encode` (str -> ids); empty ones dropped."""
    groups = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise TurboError(f"{path}: no such file or directory (expected text to train on)")
        if not path.is_dir() and not path.is_file():  # /dev/zero, a pipe: no size to check, no end to read
            raise TurboError(f"{path}: not a regular file or a directory (expected text to train on)")
        if (size := _size(path)) > MAX_GROUP_BYTES:
            raise TurboError(f"{path}: {size / 2**30:.1f} GiB of data, over the {MAX_GROUP_BYTES >> 30} GiB one data "
                             "path may hold (it is read whole): split it into several paths or pass a sample")
        docs = [ids for ids in (encode(d) for d in _documents(path)) if ids]
        if not docs:
            raise TurboError(f"{path}: no text in it (expected at least one non-empty document)")
        name = path.stem if path.is_file() else path.name
        if any(g.name == name for g in groups):
            raise TurboError(f"{path}: a second group named {name!r} (each path is one group, named after it; "
                             "expected distinct names)")
        groups.append(Group(name, docs))
    return groups


def draw(doc: list[int], length: int, rng: random.Random) -> list[int]:
    """The document itself when it fits in `length` tokens, else a window of that many."""
    if len(doc) <= length:
        return doc
    start = rng.randrange(len(doc) - length + 1)
    return doc[start:start + length]


def last_tokens(doc: list[int], length: int) -> list[int]:
    """A held-out prompt: the document, or its last `length` tokens (where it asks for more)."""
    return doc[-length:]


def build(rt, groups: list[Group], count: int, targets: str, prompt_tokens: int, new_tokens: int,
          aux_layers: tuple[int, ...], want_mtp: bool, seed: int) -> dict[str, list[Example]]:
    """`count` examples per group, every one deterministic in (seed, group, index)."""
    trunk = rt.trunk
    out: dict[str, list[Example]] = {}
    total = count * len(groups)
    with tqdm(total=total, desc="examples", unit="ex", dynamic_ncols=True) as bar:
        for gi, g in enumerate(groups):
            rng = random.Random(f"{seed}/{gi}")
            out[g.name] = []
            for _ in range(count):
                doc = g.documents[rng.randrange(len(g.documents))]
                if targets == "greedy":
                    prompt = draw(doc, prompt_tokens, rng)
                    cont = rt.generate(prompt, max_new_tokens=new_tokens, policy="off", stop_at_eos=True).tokens
                    ids, first = prompt + cont, len(prompt) - 1
                else:
                    ids, first = draw(doc, prompt_tokens + new_tokens, rng), 0
                if len(ids) - first < 2:  # nothing after the anchor to learn
                    bar.update(1)
                    continue
                out[g.name].append(_forward(trunk, ids, first, aux_layers, want_mtp))
                bar.update(1)
    return out


@torch.no_grad()
def _forward(trunk, ids: list[int], first: int, aux_layers: tuple[int, ...], want_mtp: bool) -> Example:
    st = trunk.new_state(len(ids))
    o = trunk.prefill(st, ids, aux_layers, want_logits=want_mtp)
    aux = o.aux.to("cpu", torch.float16) if aux_layers else None
    hidden = greedy = None
    if want_mtp:
        hidden = rms_norm(o.hidden, trunk.final_norm, trunk.arch.rms_eps).to("cpu", torch.float16)
        greedy = o.logits.argmax(-1).cpu()
    return Example(torch.tensor(ids), first, aux, hidden, greedy)


def batch(examples: list[Example], device: torch.device) -> dict[str, torch.Tensor]:
    """Examples padded to the longest: ids with 0, the states with zeros (never read: context
    masks and targets stop at each sequence's length)."""
    t = max(len(e.ids) for e in examples)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, t - x.shape[0]))

    out = {"ids": torch.stack([pad(e.ids) for e in examples]),
           "lengths": torch.tensor([len(e.ids) for e in examples]),
           "first": torch.tensor([e.first for e in examples])}
    for key in ("aux", "hidden", "greedy"):
        if getattr(examples[0], key) is not None:
            out[key] = torch.stack([pad(getattr(e, key)) for e in examples])
    return {k: v.to(device) for k, v in out.items()}
