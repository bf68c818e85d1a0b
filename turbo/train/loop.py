"""The long job: steps until --steps or the --minutes budget, a progress bar with the loss and
tokens/s, a checkpoint every --checkpoint-every steps (and at the end), and --resume.

Every run takes at least one step. Step s draws its batch from a generator seeded with (seed, s)
and its learning rate from the schedule at s, so a resumed run (under --steps) takes exactly the steps an
uninterrupted one would have: the same losses, to the rounding of reloading the optimizer
state. The schedule (linear warmup, then cosine to a tenth) runs over --steps when given, else
over the --minutes of training time, counted across resumes (a larger --minutes on --resume
extends the run).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ..errors import TurboError

WARMUP = 0.03
MIN_LR = 0.1


@dataclass
class Schedule:
    lr: float
    steps: int | None  # the run's length in steps (None: by time)
    minutes: float | None  # the time budget (None: no budget)
    checkpoint_every: int
    seed: int


def lr_factor(progress: float) -> float:
    """Linear warmup, then cosine to MIN_LR, over progress in [0, 1]."""
    if progress < WARMUP:
        return max(progress / WARMUP, 0.01)
    p = min(1.0, (progress - WARMUP) / (1 - WARMUP))
    return MIN_LR + (1 - MIN_LR) * 0.5 * (1 + math.cos(math.pi * p))


def save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, elapsed: float) -> None:
    """Write then rename: a kill mid-write never leaves a torn checkpoint."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed}, tmp)
    os.replace(tmp, path)


def restore(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, float]:
    """(step, elapsed seconds) of the checkpoint, its weights and optimizer state loaded."""
    try:
        ck = torch.load(path, map_location=next(model.parameters()).device, weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
    except (OSError, RuntimeError, KeyError, ValueError) as e:
        raise TurboError(f"{path}: not a checkpoint of this run ({str(e).splitlines()[0]})") from None
    return int(ck["step"]), float(ck["elapsed"])


def optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and other vectors."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train(model: torch.nn.Module, step_loss: Callable[[int, torch.Generator], tuple[torch.Tensor, dict, int]],
          sched: Schedule, work: Path, resume: bool) -> int:
    """Runs the steps; `step_loss(step, generator)` -> (loss, parts to log, tokens in the batch).
    Appends every step's parts to work/log.jsonl; returns the steps done in all."""
    opt = optimizer(model, sched.lr)
    ckpt = work / "checkpoint.pt"
    step, elapsed = restore(ckpt, model, opt) if resume and ckpt.exists() else (0, 0.0)
    if not resume:
        (work / "log.jsonl").unlink(missing_ok=True)
    budget = sched.minutes * 60 if sched.minutes is not None else None
    t0 = time.monotonic() - elapsed

    def progress() -> float:
        return step / sched.steps if sched.steps is not None else (time.monotonic() - t0) / budget

    def over() -> bool:
        return ((sched.steps is not None and step >= sched.steps)
                or (budget is not None and time.monotonic() - t0 >= budget))

    if sched.steps is not None and step >= sched.steps:  # resumed after the last step
        return step
    model.train()
    with tqdm(total=sched.steps, initial=step, desc="train", unit="step", dynamic_ncols=True) as bar, \
            (work / "log.jsonl").open("a") as log:
        while True:  # a run takes at least one step (a resumed one too)
            t_step = time.monotonic()
            for g in opt.param_groups:
                g["lr"] = sched.lr * lr_factor(progress())
            loss, parts, tokens = step_loss(step, torch.Generator().manual_seed(sched.seed * 1_000_003 + step))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            log.write(json.dumps({"step": step, "lr": opt.param_groups[0]["lr"], **parts}) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{parts['loss']:.3f}", tok_s=f"{tokens / (time.monotonic() - t_step):.0f}")
            if step % sched.checkpoint_every == 0:
                save(ckpt, model, opt, step, time.monotonic() - t0)
            if over():
                break
    save(ckpt, model, opt, step, time.monotonic() - t0)
    return step
