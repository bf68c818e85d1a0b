"""--kind trunk: fine-tunes the install's trunk itself, e.g. to speak a chat format.

The trunk is loaded into transformers' model class for its config (its `model_type`), trained in
turbo.train.loop, and written with the install's own files as a new install in --out (repack it
with `--drafter` / `--mtp` beside retrained drafters). A .jsonl --data group whose lines are
`{"messages": [...], "enable_thinking": ...}` is chat: each conversation is rendered with the chat
template (--chat-template, else the install's), the loss falls on the last assistant turn only (its
reasoning, content and end-of-turn token); any other group is raw text, a window of --seq-len
tokens per example, the loss on every token (so raw completion stays as it was). --add-tokens
appends special tokens to the tokenizer and grows the (tied) embedding by rows set to the mean of
the existing ones; --stop-tokens join generation_config.json's eos ids (a chat turn stops there).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

from ..chat.template import render
from ..errors import TurboError
from ..repack import repack
from ..store.install import open_install
from ..store.template_files import GENERATION_CONFIG, TEMPLATE_FILE
from .data import draw, read_groups
from .loop import Schedule, train

MEAN_NOISE = 0.02  # new rows: the mean row plus this much of the rows' spread, so they differ


def grow_tokenizer(src: Path, tokens: list[str]):
    """The install's tokenizer with `tokens` added as special tokens (those it has already kept)."""
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens
                            if tok.token_to_id(t) is None])
    return tok


def grown(weight: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """`weight` [V, H] with rows appended up to `rows`: the mean row plus a little noise."""
    extra = rows - weight.shape[0]
    if extra <= 0:
        return weight
    gen = torch.Generator().manual_seed(seed)
    spread = weight.float().std(0)
    new = weight.float().mean(0) + MEAN_NOISE * spread * torch.randn(extra, weight.shape[1], generator=gen)
    return torch.cat([weight.float(), new]).to(weight.dtype)


def hf_model(install, vocab: int, seed: int):
    """transformers' causal LM for the install's config.json, its weights the install's trunk."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise TurboError("--kind trunk trains the trunk in transformers' model class: pip install transformers") \
            from None

    config = json.loads((install.path / "config.json").read_text())
    if "text_config" in config:
        raise TurboError(f"{install.path}: --kind trunk trains a text-only trunk (this config nests a text_config)")
    config = AutoConfig.for_model(**(config | {"vocab_size": vocab}))
    model = AutoModelForCausalLM.from_config(config).float()
    state = {"model." + n[len("trunk."):]: install.index.load(n, torch.float32)
             for n in install.index.entries if n.startswith("trunk.")}
    state = {n: grown(t, vocab, seed) if n.endswith(("embed_tokens.weight", "lm_head.weight")) else t
             for n, t in state.items()}
    state = {("lm_head." + n[len("model.lm_head."):] if n.startswith("model.lm_head.") else n): t
             for n, t in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise TurboError(f"{install.path}: its trunk does not load into {type(model).__name__} "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model


def chat_examples(path: Path, template: str, encode, seq_len: int) -> list[tuple[list[int], int]]:
    """(ids, first target position) per conversation: the prompt up to the last assistant turn
    encoded alone (as generation sees it), then that turn; cut to seq_len + 1 tokens."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise TurboError(f"{path}:{n}: not a JSON line (expected {{\"messages\": [...]}})") from None
        messages, kwargs = item["messages"], {k: v for k, v in item.items() if k != "messages"}
        if not messages or messages[-1].get("role") != "assistant":
            raise TurboError(f"{path}:{n}: expected a conversation ending in an assistant turn")
        prompt = render(template, messages[:-1], add_generation_prompt=True, **kwargs)
        full = render(template, messages, **kwargs)
        if not full.startswith(prompt):
            raise TurboError(f"{path}:{n}: the template renders the conversation without its generation prompt "
                             "as a prefix (the last turn's loss needs it)")
        p = encode(prompt)
        ids = (p + encode(full[len(prompt):]))[:seq_len + 1]
        if len(ids) > len(p):
            out.append((ids, len(p) - 1))
    return out


def is_chat(path: Path) -> bool:
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    with path.open(encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict) and "messages" in json.loads(first)
    except ValueError:
        return False


def write_install(model, src, out: Path, tok, template: str | None, stop_ids: list[int]) -> None:
    """--out: the install's files with the trained trunk (bf16), the grown tokenizer, the template
    and the eos ids; its MTP head and DFlash drafter carried over (their vocab rows grown)."""
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        stage, drafter = Path(tmp) / "trunk", Path(tmp) / "drafter"
        stage.mkdir()
        config = json.loads((src.path / "config.json").read_text()) | {"vocab_size": vocab}
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {"trunk." + n[len("model."):]: t.detach().to(torch.bfloat16).contiguous()
                   for n, t in model.state_dict().items() if n.startswith("model.")}
        if not model.config.tie_word_embeddings:
            tensors["trunk.lm_head.weight"] = model.lm_head.weight.detach().to(torch.bfloat16).contiguous()
        for n in src.index.entries:
            if n.startswith("mtp."):
                tensors[n] = src.index.load(n, torch.bfloat16).contiguous()
        save_file(tensors, str(stage / "model.safetensors"))
        tok.save(str(stage / "tokenizer.json"))
        for f in ("tokenizer_config.json", "special_tokens_map.json", TEMPLATE_FILE):
            if (src.path / f).is_file():
                shutil.copy(src.path / f, stage / f)
        if template is not None:
            (stage / TEMPLATE_FILE).write_text(template)
        gen_path = src.path / GENERATION_CONFIG
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        eos = gen.get("eos_token_id", config.get("eos_token_id"))
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        gen["eos_token_id"] = eos + [i for i in stop_ids if i not in eos]
        (stage / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2) + "\n")
        has_drafter = (src.path / "dflash" / "config.json").is_file()
        if has_drafter:  # vocab-sized tensors (the candidate selector's codebooks) grow like the embedding
            drafter.mkdir()
            dconf = json.loads((src.path / "dflash" / "config.json").read_text()) | {"vocab_size": vocab}
            (drafter / "config.json").write_text(json.dumps(dconf, indent=2) + "\n")
            dt = {n: src.index.load(n, torch.float32) for n in src.index.entries if n.startswith("dflash.")}
            dt = {n: grown(t, vocab, 1).to(torch.bfloat16) if t.dim() == 2 and t.shape[0] == src.arch.vocab
                  else t.to(torch.bfloat16) for n, t in dt.items()}
            save_file({n: t.contiguous() for n, t in dt.items()}, str(drafter / "model.safetensors"))
        if out.exists():
            shutil.rmtree(out)
        repack(stage, out, drafter=drafter if has_drafter else None, quiet=True)


def run(args: argparse.Namespace, device: torch.device, work: Path) -> int:
    """The whole --kind trunk job; `work` is --out/train (run.json already checked)."""
    src = open_install(args.install)
    if args.chat_template and not Path(args.chat_template).is_file():
        raise TurboError(f"--chat-template {args.chat_template}: no such file (expected a Jinja chat template)")
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    if template is None and src.template_files.source is not None:
        template = src.template_files.source
    tok = grow_tokenizer(src.path, args.add_tokens or [])
    vocab = max(src.arch.vocab, tok.get_vocab_size(with_added_tokens=True))
    stop_ids = []
    for t in args.stop_tokens or []:
        if tok.token_to_id(t) is None:
            raise TurboError(f"--stop-tokens {t}: not a token of the tokenizer (add it with --add-tokens)")
        stop_ids.append(tok.token_to_id(t))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    groups: list[tuple[str, list]] = []  # (name, chat examples) or (name, raw documents)
    for p in args.data:
        path = Path(p)
        if is_chat(path):
            if template is None:
                raise TurboError(f"{path}: chat data, but no chat template (give --chat-template FILE)")
            groups.append(("chat:" + path.stem, chat_examples(path, template, encode, args.seq_len)))
        else:
            raw = read_groups([p], encode)[0]
            groups.append(("raw:" + raw.name, raw.documents))
    model = hf_model(src, vocab, args.seed).to(device)
    print(f"trunk: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {src.arch.vocab} -> {vocab}; "
          + ", ".join(f"{n} {len(x)}" for n, x in groups), file=sys.stderr, flush=True)  # reports: stderr

    def step_loss(step: int, gen: torch.Generator):
        name, items = groups[step % len(groups)]
        rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
        if name.startswith("chat:"):
            picked = [items[rng.randrange(len(items))] for _ in range(args.batch)]
        else:
            picked = [(draw(items[rng.randrange(len(items))], args.seq_len + 1, rng), 0) for _ in range(args.batch)]
        t = max(len(ids) for ids, _ in picked)
        x = torch.zeros(len(picked), t, dtype=torch.long)
        keep = torch.zeros(len(picked), t - 1, dtype=torch.bool)
        for i, (ids, first) in enumerate(picked):
            x[i, :len(ids)] = torch.tensor(ids)
            keep[i, first:len(ids) - 1] = True
        x, keep = x.to(device), keep.to(device)
        logits = model(input_ids=x[:, :-1]).logits
        per = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none").view_as(keep)
        loss = (per * keep).sum() / keep.sum().clamp(min=1)
        return loss, {"loss": loss.item(), name: loss.item()}, int(keep.sum())

    sched = Schedule(args.lr, args.steps, args.minutes, args.checkpoint_every, args.seed)
    steps = train(model, step_loss, sched, work, args.resume)
    model.eval()
    write_install(model, src, args.out / "install", tok, template, stop_ids)
    print(f"wrote {args.out / 'install'} ({steps} steps); file it with retrained drafters: python -m turbo.repack "
          f"{args.out / 'install'} NEW --drafter DFLASH2_OUT --mtp MTP_OUT", file=sys.stderr)
    return 0
