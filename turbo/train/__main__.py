"""python -m turbo.train INSTALL --kind dflash2|mtp|trunk --data FILE_OR_DIR... --out DIR [options]

Trains a DFlash2 drafter or an MTP head for INSTALL (a directory, or a shipped install's name)
on the text under --data, writes it into --out in the layout `python -m turbo.repack` files
(`--drafter OUT` for DFlash2, `--mtp OUT` for the MTP head), and measures it on held-out
prompts (--out/eval.json). --out/train/ holds the training set, the checkpoint and the log while
it runs; a finished run removes the first two (--keep-work keeps them), a run stopped before its
--steps (Ctrl-C, or --minutes spent first) keeps them: `--resume` continues there. A bad input
ends it in one line (exit 2), Ctrl-C in `interrupted`. --kind trunk fine-tunes the trunk itself
(chat turns and raw text; a new install in --out/install): turbo/train/trunk.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch

import turbo

from ..__main__ import guarded
from ..errors import ArgumentParser, TurboError
from ..store.tensor_shapes import MTP_PREFIX
from . import dflash2, heldout, mask, mtp, trunk
from .data import Example, batch, build, read_groups
from .loop import Schedule, train

MODEL_FILES = ("config.json", "model.safetensors")
# the settings a resumed run must share with the run it continues
FIXED_ON_RESUME = ("install", "kind", "from_install", "data", "targets", "examples", "prompt_tokens", "new_tokens",
                   "heads", "kv_heads", "head_dim", "intermediate", "rank", "top_k", "block", "window", "target_layers",
                   "target_count", "mask_token_id", "gamma", "batch", "anchors", "lr", "seed", "step2_weight",
                   "chat_template", "add_tokens", "stop_tokens", "seq_len")


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m turbo.train", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("install", help="the install to train for: a directory, or a shipped install's name")
    p.add_argument("--kind", required=True, choices=("dflash2", "mtp", "trunk"),
                   help="trunk: fine-tune the trunk itself (turbo/train/trunk.py)")
    p.add_argument("--data", nargs="+", default=[], metavar="FILE_OR_DIR",
                   help="text to train on; each path is one group (a directory: every file under it; .jsonl: one "
                        "document a line; else one document a file)")
    p.add_argument("--out", required=True, type=Path, help="the directory to write the drafter into")
    d = p.add_argument_group("the training set")
    d.add_argument("--targets", default="greedy", choices=("greedy", "text"),
                   help="greedy: the trunk's own continuations of prompts drawn from the text; text: the text")
    d.add_argument("--examples", type=int, default=600, help="examples per group")
    d.add_argument("--prompt-tokens", type=int, default=64,
                   help="a document up to this long is a prompt as it is; a longer one gives windows this long")
    d.add_argument("--new-tokens", type=int, default=96, help="the longest continuation (targets greedy)")
    d.add_argument("--heldout", nargs="+", default=None, metavar="FILE_OR_DIR",
                   help="held-out prompts, one group a path (default: --heldout-count documents of each --data "
                        "group, left out of training)")
    d.add_argument("--heldout-count", type=int,
                   help=f"held-out documents per group (default: a tenth, 1 to {heldout.AUTO_MOST}, of groups of at "
                        f"least {heldout.AUTO_FEWEST}; 0: no evaluation)")
    d.add_argument("--eval-tokens", type=int, default=256, help="tokens generated per held-out prompt at most")
    d.add_argument("--eval-only", action="store_true", help="measure the install's own drafter of --kind; no training")
    p.add_argument("--from-install", action="store_true",
                   help="start from the drafter of --kind the install carries, in its shape (rather than afresh)")
    s = p.add_argument_group("the DFlash2 drafter (5 layers, its width the trunk's; unset: scaled from the trunk)")
    s.add_argument("--heads", type=int)
    s.add_argument("--kv-heads", type=int)
    s.add_argument("--head-dim", type=int)
    s.add_argument("--intermediate", type=int)
    s.add_argument("--rank", type=int, help="the candidate selector's rank")
    s.add_argument("--top-k", type=int, default=16, help="the candidate selector's candidates per row")
    s.add_argument("--block", type=int, default=8, help="the block size it trains for")
    s.add_argument("--window", type=int, default=256, help="its sliding window (context positions)")
    s.add_argument("--target-layers", type=int, nargs="+", help="trunk layer ids (default: --target-count spread)")
    s.add_argument("--target-count", type=int, default=5, help="how many trunk layers condition it")
    s.add_argument("--mask-token-id", type=int,
                   help="default: the tokenizer's <|mask|>, else the first embedding row past its tokens, else its "
                        "first reserved special token (said on stderr)")
    s.add_argument("--gamma", type=float, help="the loss's position decay (default: the published one per block)")
    k = p.add_argument_group("the trunk (--kind trunk)")
    k.add_argument("--chat-template", help="a Jinja chat template file for the chat groups and the new install "
                                           "(default: the install's)")
    k.add_argument("--add-tokens", nargs="+", metavar="TOKEN", help="special tokens to append to the tokenizer")
    k.add_argument("--stop-tokens", nargs="+", metavar="TOKEN", help="tokens joining generation_config's eos ids")
    k.add_argument("--seq-len", type=int, default=256, help="tokens per example at most")
    t = p.add_argument_group("the job")
    t.add_argument("--steps", type=int, help="steps in all (the schedule runs over them)")
    t.add_argument("--minutes", type=float, help="the training time budget, across resumes")
    t.add_argument("--batch", type=int, default=16, help="sequences per step")
    t.add_argument("--anchors", type=int, default=8, help="blocks per sequence per step (DFlash2)")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--step2-weight", type=float, default=0.5, help="the chained step's loss weight (MTP)")
    t.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    t.add_argument("--keep-work", action="store_true",
                   help="keep --out/train's training set and checkpoint after a finished run (to --resume it "
                        "later with more --steps or --minutes)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the trunk and the training run (auto: cuda when torch sees a GPU)")
    t.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    return p


def check(args: argparse.Namespace) -> None:

    for name in ("examples", "prompt_tokens", "new_tokens", "eval_tokens", "batch", "anchors", "checkpoint_every",
                 "steps", "threads", "target_count", "seq_len", "heads", "kv_heads", "head_dim", "intermediate", "rank",
                 "top_k", "block", "window"):
        v = getattr(args, name)
        if v is not None and v < 1:  # (a 0 must not pass for "unset": --heads 0 took the default)
            raise TurboError(f"--{name.replace('_', '-')} {v}: expected a positive integer")
    if args.block is not None and args.seq_len is not None and args.block >= args.seq_len:
        # (a block's rows are positions of one example: a wider one predicts nothing it can check,
        # and sizes tensors past memory)
        raise TurboError(f"--block {args.block}: expected fewer than --seq-len {args.seq_len} tokens (a block is "
                         "drafted inside one example)")
    for name in ("lr", "gamma", "step2_weight"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and (v > 0 or name == "step2_weight" and v == 0)):
            raise TurboError(f"--{name.replace('_', '-')} {v}: expected a finite number above 0"
                             + (" (or 0)" if name == "step2_weight" else ""))
    if args.heldout_count is not None and args.heldout_count < 0:
        raise TurboError(f"--heldout-count {args.heldout_count}: expected 0 or more")
    if args.minutes is not None and not args.minutes > 0:
        raise TurboError(f"--minutes {args.minutes}: expected a positive number")
    if not args.eval_only:
        if not args.data:
            raise TurboError("--data: expected at least one file or directory to train on")
        if args.steps is None and args.minutes is None:
            raise TurboError("expected --steps or --minutes (how long to train)")
        run_json = args.out / "train" / "run.json"
        if args.resume != run_json.is_file():
            raise TurboError(f"{args.out}: " + ("no run to resume there (drop --resume)" if args.resume else
                                                "already holds a run (--resume continues it; or a new --out)"))
        if args.resume and json.loads(run_json.read_text()).get("work_removed"):
            raise TurboError(f"--resume: the run in {args.out} finished and its training set and checkpoint were "
                             "removed (--keep-work keeps them; or a new --out)")


def settings(args: argparse.Namespace) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k in FIXED_ON_RESUME}


def check_resume(args: argparse.Namespace, work: Path) -> None:

    had = json.loads((work / "run.json").read_text())["settings"]
    for k, v in settings(args).items():
        if had.get(k) != v:
            raise TurboError(f"--resume: --{k.replace('_', '-')} is {v!r}, the run in {work.parent} has {had.get(k)!r}")


def save_dataset(path: Path, sets: dict) -> None:


    torch.save({name: [asdict(e) for e in ex] for name, ex in sets.items()}, path)


def load_dataset(path: Path) -> dict:


    return {name: [Example(**e) for e in ex] for name, ex in torch.load(path, weights_only=True).items()}


def own_weights(install, prefix: str) -> dict:
    """The install's tensors under `prefix`, named as the trainable model names them."""

    index = install.index
    return {n[len(prefix):]: index.load(n, torch.float32) for n in index.entries if n.startswith(prefix)}


def make_model(args: argparse.Namespace, install, mask_token: int | None, drafter_config):
    """(the model to train, the trunk layers its data needs, its shape as recorded, the loss's gamma);
    --from-install: the install's own drafter of --kind (its parsed DFlash config: `drafter_config`);
    `mask_token`: a new DFlash2 drafter's."""


    arch = install.arch
    embed = install.index.load("trunk.embed_tokens.weight", torch.float32)
    lm_head = embed if arch.tie_embeddings else install.index.load("trunk.lm_head.weight", torch.float32)
    torch.manual_seed(args.seed)
    if args.kind == "mtp":
        if not arch.full_layers:
            raise TurboError(f"{install.path}: the trunk has no full-attention layer to start an MTP head from")
        head = mtp.MtpHead(arch, embed, lm_head)
        if not args.from_install:
            head.init_from_trunk(install)
        elif install.has_mtp:
            head.load_state_dict(own_weights(install, MTP_PREFIX))
        else:
            raise TurboError(f"--from-install: {install.path} carries no MTP head")
        return head, (), {"hidden": arch.hidden, "from_layer": arch.full_layers[-1]}, None
    if args.from_install:
        c = drafter_config
        if c is None or not c.has_conv:
            raise TurboError(f"--from-install: {install.path} carries no DFlash2 drafter")
        shape = dflash2.draft_shape(arch, c.mask_token, c.heads, c.kv_heads, c.head_dim, c.intermediate, c.rank,
                                    c.top_k, c.block_size, c.window, list(c.target_layers))
    else:
        shape = dflash2.draft_shape(arch, mask_token, args.heads, args.kv_heads, args.head_dim, args.intermediate,
                                    args.rank, args.top_k, args.block, args.window, args.target_layers,
                                    args.target_count)
    model = dflash2.DFlash2(shape, embed, lm_head)
    if args.from_install:
        model.load_state_dict(own_weights(install, "dflash."))
    gamma = args.gamma if args.gamma is not None else dflash2.default_gamma(shape.block)
    return model, shape.target_layers, dflash2.shape_record(shape), gamma


def step_losses(args: argparse.Namespace, model, sets: dict, gamma: float | None, device):
    """step_loss(step, generator) for turbo.train.loop.train: one group per step, in turn (every
    group weighs alike), --batch examples of it, --anchors blocks in each (DFlash2)."""


    names = [n for n, ex in sets.items() if ex]

    def step_loss(step: int, gen: torch.Generator):
        ex = sets[names[step % len(names)]]
        pick = torch.randint(0, len(ex), (args.batch,), generator=gen).tolist()
        b = batch([ex[i] for i in pick], device)
        if args.kind == "mtp":
            loss, parts = mtp.loss(model, b["ids"], b["hidden"], b["greedy"], b["lengths"], args.step2_weight)
        else:  # anchors uniform over [first, length - 2]: every block has a target
            span = (b["lengths"] - 1 - b["first"]).cpu()
            u = torch.rand(args.batch, args.anchors, generator=gen)
            anchors = (b["first"].cpu()[:, None] + (u * span[:, None]).long()).to(device)
            loss, parts = dflash2.loss(model, b["ids"], b["aux"], b["lengths"], anchors, gamma)
        return loss, parts, int(b["lengths"].sum())
    return step_loss


def run(args: argparse.Namespace) -> int:


    check(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise TurboError("--device cuda: torch sees no GPU (expected a CUDA build of torch and a visible device)")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if args.kind == "trunk":
        if args.eval_only or args.from_install:
            raise TurboError("--kind trunk: --eval-only and --from-install are for drafters (the trunk is the "
                             "install's)")
        work = args.out / "train"
        work.mkdir(parents=True, exist_ok=True)
        if args.resume:
            check_resume(args, work)
        else:
            (work / "run.json").write_text(json.dumps({"settings": settings(args)}, indent=2) + "\n")
        return trunk.run(args, device, work)
    rt = turbo.open(args.install, backend=device.type)
    install, tokenizer = rt.install, rt.tokenizer

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text).ids

    groups = read_groups(args.data, encode) if args.data else []
    notes = []  # said on stderr once the inputs are known good (a bad one is then its one line)
    if args.heldout is not None:
        held = read_groups(args.heldout, encode)
    elif args.heldout_count != 0 and groups:
        groups, held = heldout.split(groups, args.heldout_count, args.seed)
        notes.append(heldout.said(groups, held))
    else:
        held = []
    prompts = heldout.prompts_of(held, args.prompt_tokens, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.eval_only:
        if not prompts:
            raise TurboError("--eval-only: expected --heldout FILE_OR_DIR (prompts to measure on)")
        trained = rt.drafter_config.block_size if args.kind == "dflash2" and rt.drafter_config else None
        result = heldout.evaluate(install.path, args.out, args.kind, prompts, heldout.blocks_for(trained),
                                  args.eval_tokens, device.type, None)
        print(heldout.table(result))
        return 0

    work = args.out / "train"
    work.mkdir(exist_ok=True)
    if args.resume:
        check_resume(args, work)
    mask_token = args.mask_token_id
    if args.kind == "dflash2" and not args.from_install and mask_token is None:
        chosen = mask.choose(tokenizer, install.arch.vocab)
        notes.append(f"mask token {chosen.token}: {chosen.why} (--mask-token-id sets it)")
        mask_token = chosen.token
    model, aux_layers, record, gamma = make_model(args, install, mask_token, rt.drafter_config)
    for note in notes:
        print(note, file=sys.stderr)
    data_path = work / "dataset.pt"
    if args.resume and data_path.is_file():
        sets = load_dataset(data_path)
    else:
        sets = build(rt, groups, args.examples, args.targets, args.prompt_tokens, args.new_tokens, aux_layers,
                     args.kind == "mtp", args.seed)
        save_dataset(data_path, sets)
    if not any(sets.values()):
        raise TurboError("no training examples: every continuation ended at once (try --targets text)")
    (work / "run.json").write_text(json.dumps({"settings": settings(args), "shape": record,
                                               "examples": {n: len(ex) for n, ex in sets.items()}}, indent=2) + "\n")
    del rt  # its weights are not needed while training
    model.to(device)
    steps = train(model, step_losses(args, model, sets, gamma, device),
                  Schedule(args.lr, args.steps, args.minutes, args.checkpoint_every, args.seed), work, args.resume)
    model.cpu()
    (dflash2.export if args.kind == "dflash2" else mtp.export)(model, args.out)
    # a run stopped before its --steps keeps what --resume needs; a finished one, only its log and record
    finished = args.steps is None or steps >= args.steps
    removed = finished and not args.keep_work
    run_record = json.loads((work / "run.json").read_text()) | {"steps": steps, "work_removed": removed}
    (work / "run.json").write_text(json.dumps(run_record, indent=2) + "\n")
    if removed:
        for name in ("dataset.pt", "checkpoint.pt"):
            (work / name).unlink(missing_ok=True)
    flag = "--drafter" if args.kind == "dflash2" else "--mtp"
    kept = ("removed its training set and checkpoint (--keep-work keeps them)" if removed
            else f"kept {work} for --resume")
    print(f"wrote {args.out} ({steps} steps; {kept}); file it: python -m turbo.repack {install.path} NEW {flag} "
          f"{args.out}", file=sys.stderr)  # a report: stdout holds the held-out table alone
    if prompts:
        result = heldout.evaluate(install.path, args.out, args.kind, prompts,
                                  heldout.blocks_for(record.get("block") if args.kind == "dflash2" else None),
                                  args.eval_tokens, device.type, args.out)
        print(heldout.table(result))
    return 0


def main(argv: list[str] | None = None) -> int:

    args = parser().parse_args(argv)
    return guarded(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
