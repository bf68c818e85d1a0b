#!/usr/bin/env python
"""Train the bundled `tiny` model: a small Qwen3.5 trunk and its DFlash2 drafter.

Everything is built from material present on every Python machine, so the run
is reproducible anywhere without downloads:

* code  = the Python standard library's own ``.py`` sources,
* prose = English from the stdlib (``pydoc_data.topics`` and docstrings),
* math  = generated multi-step arithmetic problems with worked answers.

Stages (``--stage``; ``all`` runs them in order, each skipped when its output
exists unless ``--force``):

    corpus        collect and split the three workloads (held-out files/seeds)
    tokenizer     byte-level BPE, 4096 ids incl. <|endoftext|> and <|mask|>
    workloads     conf/workload/{prose,code,math}.yaml from held-out material
    trunk         train transformers.Qwen3_5ForCausalLM (fp32) -> build/tiny_hf
    continuations the trunk's own greedy continuations + aux hidden states
    drafter       train the DFlash2 drafter (docs/DESIGN.md 2.2) on those continuations
    export        drafter -> build/tiny_dflash (published, unprefixed names)
    report        build/TRAINING.md (sizes, data, losses, accuracy, samples)

``--resume`` continues a killed ``trunk`` or ``drafter`` run from its last
checkpoint (written every ``--ckpt-minutes``).  Learning-rate schedules follow
the fraction of the *time budget* spent (the CPUs are shared, so step rates
vary); pass ``--trunk-steps`` / ``--drafter-steps`` for a step-based schedule
that is exactly reproducible.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

WORKLOADS = ("prose", "code", "math")
EOS = "<|endoftext|>"
MASK = "<|mask|>"
STAGES = ("corpus", "tokenizer", "workloads", "trunk", "continuations", "drafter", "export", "report")


# --------------------------------------------------------------------------
# Hyper-parameters (all recorded to <work>/hparams.json)
# --------------------------------------------------------------------------
@dataclasses.dataclass
class HParams:
    seed: int = 1234
    vocab_size: int = 4096
    # trunk
    hidden: int = 256
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 768
    lin_k_heads: int = 2
    lin_v_heads: int = 4
    lin_k_dim: int = 64
    lin_v_dim: int = 64
    rope_theta: float = 10_000_000.0
    seq_len: int = 256
    batch: int = 16
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_frac: float = 0.03
    weight_decay: float = 0.1
    trunk_minutes: float = 55.0
    trunk_steps: int = 0  # 0 = time-budget schedule
    # continuations
    prefix_len: int = 64
    cont_len: int = 96
    cont_train_per_workload: int = 600
    cont_eval_per_workload: int = 64
    gen_batch: int = 150
    # drafter
    d_layers: int = 5
    block_size: int = 8
    conv_taps: int = 2
    conv_group: int = 16
    selector_rank: int = 32
    selector_top_k: int = 16
    sliding_window: int = 256
    target_layer_ids: tuple[int, ...] = (1, 3, 5, 6)
    gamma: float = 4.0
    d_lr: float = 2e-3
    d_batch_seqs: int = 16
    d_anchors: int = 8
    drafter_minutes: float = 25.0
    drafter_steps: int = 0
    # bookkeeping
    ckpt_minutes: float = 4.0
    eval_minutes: float = 5.0


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def stable_hash(s: str) -> int:
    """A process-independent hash (Python's hash() is salted)."""
    return int(hashlib.sha1(s.encode()).hexdigest()[:8], 16)


def atomic_save(obj: Any, path: Path) -> None:
    """Write then rename, so a kill mid-write never leaves a torn checkpoint."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Logger:
    """Prints and appends JSON lines to <work>/metrics.jsonl."""

    def __init__(self, work: Path) -> None:
        self.path = work / "metrics.jsonl"

    def log(self, stage: str, **kv: Any) -> None:
        kv = {"time": time.strftime("%H:%M:%S", time.gmtime()), "stage": stage, **kv}
        tqdm.write(json.dumps(kv))
        with open(self.path, "a") as f:
            f.write(json.dumps(kv) + "\n")


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------
def stdlib_files() -> list[Path]:
    """Standard-library .py files (no site-packages, no test suites: they are
    huge and repetitive), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idle_test", "__pycache__", "dist-packages")
    files = [p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts)]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def is_heldout_file(rel: str) -> bool:
    """A fixed ~4% of stdlib files is held out for eval (by name hash)."""
    return stable_hash(rel) % 25 == 0


def docstrings_of(source: str, module: str) -> list[str]:
    """Module/class/function docstrings long enough to read like prose."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 100:
                name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
                out.append(f"{name}\n\n{doc.strip()}\n")
    return out


NAMES = ["Alice", "Bob", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas",
         "Kira", "Liam", "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = ["apples", "marbles", "books", "stamps", "coins", "pencils", "cards", "shells",
         "stickers", "eggs", "bolts", "tickets"]
CONTAINERS = ["boxes", "bags", "crates", "jars", "packs", "baskets"]


def math_problem(rng: random.Random) -> str:
    """One multi-step arithmetic problem with its worked answer."""
    if rng.random() < 0.5:
        # expression chain, evaluated left to right with explicit steps
        n = rng.randint(2, 5)
        value = rng.randint(2, 99)
        expr = str(value)
        steps = []
        for _ in range(n):
            op = rng.choice("+-*/" if value > 1 else "+*")
            if op == "*":
                b = rng.randint(2, 12)
                new = value * b
            elif op == "/":
                divisors = [d for d in range(2, 13) if value % d == 0]
                if not divisors:
                    op, b = "+", rng.randint(1, 99)
                    new = value + b
                else:
                    b = rng.choice(divisors)
                    new = value // b
            elif op == "-":
                b = rng.randint(1, max(1, value))
                new = value - b
            else:
                b = rng.randint(1, 99)
                new = value + b
            steps.append(f"{value} {op} {b} = {new}")
            expr = f"({expr} {op} {b})" if len(steps) < n else f"{expr} {op} {b}"
            value = new
        return f"Problem: Compute {expr}.\nSolution:\n" + "\n".join(steps) + f"\nAnswer: {value}\n"
    # word problem
    name, other = rng.sample(NAMES, 2)
    item, box = rng.choice(ITEMS), rng.choice(CONTAINERS)
    start, k, per = rng.randint(5, 60), rng.randint(2, 9), rng.randint(3, 15)
    gain = k * per
    lines = [f"{name} has {start} {item}.",
             f"{name} buys {k} {box} with {per} {item} in each.",]
    steps = [f"{k} * {per} = {gain}", f"{start} + {gain} = {start + gain}"]
    total = start + gain
    if rng.random() < 0.7:
        give = rng.randint(1, total - 1)
        lines.append(f"Then {name} gives {give} {item} to {other}.")
        steps.append(f"{total} - {give} = {total - give}")
        total -= give
    if rng.random() < 0.5:
        parts = [d for d in range(2, 7) if total % d == 0]
        if parts:
            d = rng.choice(parts)
            lines.append(f"{name} shares the {item} equally among {d} friends.")
            steps.append(f"{total} / {d} = {total // d}")
            total //= d
            question = f"How many {item} does each friend get?"
        else:
            question = f"How many {item} does {name} have now?"
    else:
        question = f"How many {item} does {name} have now?"
    return ("Problem: " + " ".join(lines) + f" {question}\nSolution:\n"
            + "\n".join(steps) + f"\nAnswer: {total}\n")


def math_docs(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [math_problem(rng) for _ in range(count)]


def comment_blocks(source: str, min_lines: int = 3) -> list[str]:
    """Runs of >= min_lines full-line comments: English written by the authors."""
    out, run = [], []
    for line in source.splitlines() + [""]:
        st = line.strip()
        if st.startswith("#") and not st.startswith("#!"):
            run.append(st.lstrip("#").strip())
        else:
            text = "\n".join(run).strip()
            if len(run) >= min_lines and len(text) >= 150 and text.count(" ") > len(text) / 12:
                out.append(text + "\n")
            run = []
    return out


PROSE_FILES = ("idlelib/NEWS.txt", "idlelib/NEWS2x.txt", "idlelib/HISTORY.txt", "idlelib/extend.txt",
               "idlelib/README.txt", "email/architecture.rst")


def build_corpus(work: Path, hp: HParams, log: Logger) -> None:
    """Writes <work>/corpus/{w}_{train,eval}.json (lists of documents)."""
    out = work / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: dict[str, list[str]] = {f"{w}_{s}": [] for w in WORKLOADS for s in ("train", "eval")}
    for path in tqdm(stdlib_files(), desc="stdlib"):
        rel = str(path.relative_to(root))
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        split = "eval" if is_heldout_file(rel) else "train"
        if len(text) > 200:
            docs[f"code_{split}"].append(text)
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        docs[f"prose_{split}"].extend(docstrings_of(text, module))
        docs[f"prose_{split}"].extend(comment_blocks(text))
    for rel in PROSE_FILES:  # the few plain-English text files shipped with the stdlib
        f = root / rel
        if f.exists():
            paras = [p.strip() + "\n" for p in f.read_text(encoding="utf-8", errors="replace").split("\n\n")]
            docs["prose_train"].extend(p for p in paras if len(p) > 80)
    from pydoc_data.topics import topics  # the stdlib's own help texts

    for key in sorted(topics):
        split = "eval" if stable_hash("topic:" + key) % 10 == 0 else "train"
        docs[f"prose_{split}"].append(topics[key].strip() + "\n")
    # math: training seeds and eval seeds never overlap
    docs["math_train"] = math_docs(hp.seed, 60_000)
    docs["math_eval"] = math_docs(hp.seed + 99_991, 600)
    for name, items in docs.items():
        (out / f"{name}.json").write_text(json.dumps(items))
        log.log("corpus", split=name, docs=len(items), chars=sum(map(len, items)))


def load_docs(work: Path, name: str) -> list[str]:
    return json.loads((work / "corpus" / f"{name}.json").read_text())


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------
def train_tokenizer(work: Path, hp: HParams, log: Logger) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()  # exact byte round-trip
    trainer = trainers.BpeTrainer(
        vocab_size=hp.vocab_size,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(hp.seed)

    def sample() -> Iterator[str]:
        # a balanced sample: about 3 MB of each workload
        for w in WORKLOADS:
            items = load_docs(work, f"{w}_train")
            rng.shuffle(items)
            budget = 3_000_000
            for d in items:
                if budget <= 0:
                    break
                budget -= len(d)
                yield d

    tok.train_from_iterator(sample(), trainer=trainer)
    tok.save(str(work / "tokenizer.json"))
    log.log("tokenizer", vocab=tok.get_vocab_size(), eos=tok.token_to_id(EOS), mask=tok.token_to_id(MASK))
    # tokenize every split into one stream per split (documents joined by EOS)
    eos = tok.token_to_id(EOS)
    for w in WORKLOADS:
        for split in ("train", "eval"):
            ids: list[int] = []
            items = load_docs(work, f"{w}_{split}")
            for enc in tok.encode_batch(items):
                ids.extend(enc.ids)
                ids.append(eos)
            torch.save(torch.tensor(ids, dtype=torch.int16), work / f"tokens_{w}_{split}.pt")
            log.log("tokenizer", split=f"{w}_{split}", tokens=len(ids))
    sample_text = "def f(x):\n    return x ** 2  # héllo\n"
    assert tok.decode(tok.encode(sample_text).ids) == sample_text, "tokenizer must round-trip"


def tokenizer_config(eos: str = EOS) -> dict[str, Any]:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
            "mask_token": MASK, "bos_token": None, "add_bos_token": False, "model_max_length": 2048,
            "clean_up_tokenization_spaces": False}


def load_tokens(work: Path, w: str, split: str) -> torch.Tensor:
    return torch.load(work / f"tokens_{w}_{split}.pt").long()


# --------------------------------------------------------------------------
# Workload prompts (held-out material only)
# --------------------------------------------------------------------------
def write_workloads(work: Path, hp: HParams, repo: Path, log: Logger, n: int = 10) -> None:
    rng = random.Random(hp.seed + 7)
    prompts: dict[str, list[str]] = {}
    # code: the head of a held-out function or class, a few lines long
    code = []
    for text in load_docs(work, "code_eval"):
        lines = text.splitlines()
        starts = [i for i, l in enumerate(lines) if l.lstrip().startswith(("def ", "class "))]
        if starts:
            i = rng.choice(starts)
            snippet = "\n".join(lines[i:i + 6]).rstrip()
            if 80 < len(snippet) < 400 and snippet + "\n" not in code:
                code.append(snippet + "\n")  # one snippet per held-out file: variety
    rng.shuffle(code)
    prompts["code"] = code[:n]
    # prose: the first few lines of held-out docstrings / help topics
    prose = []
    for text in load_docs(work, "prose_eval"):
        lines = [l for l in text.splitlines()][:5]
        snippet = "\n".join(lines).rstrip()
        if 120 < len(snippet) < 400:
            prose.append(snippet + "\n")
    rng.shuffle(prose)
    prompts["prose"] = prose[:n]
    # math: held-out seed; the prompt stops after "Solution:" so the model works it
    prompts["math"] = [d.split("Solution:\n")[0] + "Solution:\n" for d in math_docs(hp.seed + 424_242, n)]
    out = repo / "conf" / "workload"
    out.mkdir(parents=True, exist_ok=True)
    for w in WORKLOADS:
        assert len(prompts[w]) >= 8, (w, len(prompts[w]))
        body = [f"# Held-out {w} prompts written by scripts/train_tiny.py (not in the training data).",
                f"name: {w}", "max_new_tokens: 256", "prompts:"]
        body += [f"  - {json.dumps(p)}" for p in prompts[w]]  # JSON strings are valid YAML
        (out / f"{w}.yaml").write_text("\n".join(body) + "\n")
        log.log("workloads", workload=w, prompts=len(prompts[w]))


# --------------------------------------------------------------------------
# Trunk
# --------------------------------------------------------------------------
def trunk_config(hp: HParams, eos_id: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=hp.vocab_size, hidden_size=hp.hidden, intermediate_size=hp.intermediate,
        num_hidden_layers=hp.layers, num_attention_heads=hp.heads, num_key_value_heads=hp.kv_heads,
        head_dim=hp.head_dim, linear_num_key_heads=hp.lin_k_heads, linear_num_value_heads=hp.lin_v_heads,
        linear_key_head_dim=hp.lin_k_dim, linear_value_head_dim=hp.lin_v_dim, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(hp.layers)],
        tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": hp.rope_theta, "partial_rotary_factor": 0.25},
        eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None,
    )


def sample_batch(streams: dict[str, torch.Tensor], hp: HParams, step: int, seed: int,
                 length: int) -> tuple[torch.Tensor, list[str]]:
    """A balanced batch (workloads rotate), deterministic in (seed, step) so a
    resumed run sees the same data it would have seen."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rows, names = [], []
    for b in range(hp.batch):
        w = WORKLOADS[(b + step) % len(WORKLOADS)]
        s = streams[w]
        off = int(torch.randint(0, len(s) - length - 1, (1,), generator=g))
        rows.append(s[off:off + length + 1])
        names.append(w)
    return torch.stack(rows), names


def eval_windows(streams: dict[str, torch.Tensor], length: int, count: int) -> dict[str, torch.Tensor]:
    """Fixed, evenly spaced held-out windows per workload."""
    out = {}
    for w, s in streams.items():
        n = min(count, (len(s) - 1) // (length + 1))
        step = (len(s) - length - 1) // n
        out[w] = torch.stack([s[i * step:i * step + length + 1] for i in range(n)])
    return out


@torch.no_grad()
def val_losses(model: nn.Module, windows: dict[str, torch.Tensor], bs: int = 8) -> dict[str, float]:
    model.eval()
    res = {}
    for w, x in windows.items():
        tot, cnt = 0.0, 0
        for i in range(0, len(x), bs):
            xb = x[i:i + bs]
            logits = model(input_ids=xb[:, :-1]).logits
            tot += F.cross_entropy(logits.flatten(0, 1), xb[:, 1:].flatten(), reduction="sum").item()
            cnt += xb[:, 1:].numel()
        res[w] = round(tot / cnt, 4)
    model.train()
    return res


def lr_factor(progress: float, warmup: float, min_frac: float) -> float:
    """Linear warmup then cosine to min_frac, over progress in [0, 1]."""
    if progress < warmup:
        return max(progress / warmup, 0.01)
    p = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * p))


def resume_checkpoint(path: Path, model, opt, log, stage: str) -> tuple[int, float]:
    """Load model + optimizer from a stage checkpoint if one exists; (step, elapsed seconds)."""
    if not path.exists():
        return 0, 0.0
    ck = torch.load(path, weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    log.log(stage, resumed_from_step=ck["step"], elapsed_s=round(ck["elapsed"]))
    return ck["step"], ck["elapsed"]


def make_optimizer(params: list[nn.Parameter], lr: float, wd: float) -> torch.optim.Optimizer:
    # no weight decay on norms, biases and small vectors
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


class Budget:
    """Progress through a run: by steps when `steps` > 0, else by seconds of
    training time (carried across resumes)."""

    def __init__(self, steps: int, minutes: float, elapsed: float = 0.0) -> None:
        self.steps, self.seconds, self.elapsed = steps, minutes * 60.0, elapsed
        self.t0 = time.time() - elapsed

    def now(self) -> float:
        return time.time() - self.t0

    def progress(self, step: int) -> float:
        return step / self.steps if self.steps > 0 else self.now() / self.seconds

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0


class ThreadTuner:
    """The two CPUs are shared with other jobs. When another process holds a
    core, two intra-op threads are slower than one (every op waits for the
    starved thread), so every `period_s` try the other thread count for a few
    steps and keep whichever steps faster."""

    def __init__(self, max_threads: int, period_s: float = 90.0, trial: int = 3) -> None:
        self.max, self.period, self.trial = max_threads, period_s, trial
        self.cur, self.recent = max_threads, []
        self.trying: int | None = None
        self.trial_times: list[float] = []
        self.next_trial = time.time() + period_s
        torch.set_num_threads(self.cur)

    def record(self, dt: float) -> None:
        if self.max <= 1:
            return
        if self.trying is None:
            self.recent = (self.recent + [dt])[-5:]
            if time.time() > self.next_trial and len(self.recent) >= 3:
                self.trying = 1 if self.cur > 1 else self.max
                self.trial_times = []
                torch.set_num_threads(self.trying)
            return
        self.trial_times.append(dt)
        if len(self.trial_times) >= self.trial:
            mine = sorted(self.recent)[len(self.recent) // 2]
            theirs = sorted(self.trial_times)[len(self.trial_times) // 2]
            if theirs < mine:
                tqdm.write(f"[threads] {self.trying} thread(s) step faster ({theirs:.2f}s vs {mine:.2f}s): switching")
                self.cur, self.recent = self.trying, self.trial_times[-5:]
            self.trying = None
            torch.set_num_threads(self.cur)
            self.next_trial = time.time() + self.period


def save_trunk_hf(model: nn.Module, work: Path, out: Path) -> None:
    """The HF checkpoint directory: bf16 weights via save_pretrained, plus tokenizer."""
    import copy

    out.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to(torch.bfloat16)
    m.config.dtype = "bfloat16"
    m.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.json").write_text((work / "tokenizer.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    gen = out / "generation_config.json"
    if gen.exists():
        gen.unlink()  # not part of the install format; greedy is the runtime's default


def train_trunk(work: Path, hp: HParams, build: Path, log: Logger, resume: bool) -> None:
    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForCausalLM

    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    set_seed(hp.seed)
    model = Qwen3_5ForCausalLM(trunk_config(hp, eos)).float()
    opt = make_optimizer(list(model.parameters()), hp.lr, hp.weight_decay)
    ckpt_path = work / "trunk_ckpt.pt"
    step, elapsed = resume_checkpoint(ckpt_path, model, opt, log, "trunk") if resume else (0, 0.0)
    n_params = sum(p.numel() for p in model.parameters())
    log.log("trunk", params=n_params, seq_len=hp.seq_len, batch=hp.batch)
    streams = {w: load_tokens(work, w, "train") for w in WORKLOADS}
    ev = eval_windows({w: load_tokens(work, w, "eval") for w in WORKLOADS}, hp.seq_len, 16)
    budget = Budget(hp.trunk_steps, hp.trunk_minutes, elapsed)
    last_ckpt = last_eval = budget.now()
    run_loss: dict[str, float] = {}
    bar = tqdm(desc="trunk", unit="step", initial=step, dynamic_ncols=True, mininterval=10)
    t_first, tok_first, start_step = time.time(), 0, step
    tuner = ThreadTuner(torch.get_num_threads())
    model.train()
    while not budget.done(step):
        t_step = time.time()
        for g in opt.param_groups:
            g["lr"] = hp.lr * lr_factor(budget.progress(step), hp.warmup_frac, hp.min_lr_frac)
        x, names = sample_batch(streams, hp, step, hp.seed, hp.seq_len)
        logits = model(input_ids=x[:, :-1]).logits
        per_tok = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(len(x), -1)
        loss = per_tok.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tuner.record(time.time() - t_step)
        per_seq = per_tok.detach().mean(1)
        for w in WORKLOADS:  # running (EMA) train loss per workload
            sel = [i for i, n in enumerate(names) if n == w]
            if sel:
                v = per_seq[sel].mean().item()
                run_loss[w] = v if w not in run_loss else 0.98 * run_loss[w] + 0.02 * v
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
        if step == start_step + 1:  # the first step pays one-off set-up costs: time from its end
            t_first = time.time()
        elif tok_first >= 0:
            tok_first += x[:, 1:].numel()
            if time.time() - t_first > 60:
                log.log("trunk", first_minute_tokens_per_s=round(tok_first / (time.time() - t_first)))
                tok_first = -1
        now = budget.now()
        if now - last_eval > hp.eval_minutes * 60:
            last_eval = now
            log.log("trunk", step=step, elapsed_min=round(now / 60, 1), lr=opt.param_groups[0]["lr"],
                    train_loss={w: round(v, 4) for w, v in run_loss.items()}, val_loss=val_losses(model, ev))
        if now - last_ckpt > hp.ckpt_minutes * 60:
            last_ckpt = now
            atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                         "elapsed": now}, ckpt_path)
    bar.close()
    now = budget.now()
    atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": now}, ckpt_path)
    log.log("trunk", final=True, step=step, elapsed_min=round(now / 60, 1),
            train_loss={w: round(v, 4) for w, v in run_loss.items()}, val_loss=val_losses(model, ev))
    save_trunk_hf(model, work, build / "tiny_hf")
    log.log("trunk", saved=str(build / "tiny_hf"))


def load_trunk_hf(path: Path) -> nn.Module:
    """The shipped (bf16) trunk, computed in fp32 as the CPU runtime does."""
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# --------------------------------------------------------------------------
# Continuations: the trunk's greedy tokens + the aux hidden states
# --------------------------------------------------------------------------
@torch.no_grad()
def greedy(model: nn.Module, prefix: torch.Tensor, n: int) -> torch.Tensor:
    """Batched greedy decode with the HF cache (equal-length prefixes: no padding)."""
    out = model(input_ids=prefix, use_cache=True)
    past = out.past_key_values
    tok = out.logits[:, -1].argmax(-1)
    toks = [tok]
    for _ in range(n - 1):
        out = model(input_ids=tok[:, None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1].argmax(-1)
        toks.append(tok)
    return torch.stack(toks, 1)


@torch.no_grad()
def aux_states(model: nn.Module, ids: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Per-position outputs of the given decoder layers, concatenated: [B, T, n_aux*H].
    Read with forward hooks on the layers themselves, so there is no doubt
    about which entry of `hidden_states` is meant (layer i = hidden_states[i+1])."""
    got: dict[int, torch.Tensor] = {}
    hooks = []
    for i in layer_ids:
        def hook(_m, _inp, out, i=i):
            got[i] = out[0] if isinstance(out, tuple) else out
        hooks.append(model.model.layers[i].register_forward_hook(hook))
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[i] for i in layer_ids], -1)


def make_continuations(work: Path, hp: HParams, build: Path, log: Logger) -> None:
    model = load_trunk_hf(build / "tiny_hf")
    for split, count in (("eval", hp.cont_eval_per_workload), ("train", hp.cont_train_per_workload)):
        for wi, w in enumerate(WORKLOADS):
            path = work / f"cont_{w}_{split}.pt"
            if path.exists():
                continue
            s = load_tokens(work, w, split)
            g = torch.Generator().manual_seed(hp.seed + 31 * wi + (0 if split == "train" else 7))
            offs = torch.randint(0, len(s) - hp.prefix_len - 1, (count,), generator=g)
            seqs, auxs = [], []
            for i in tqdm(range(0, count, hp.gen_batch), desc=f"cont {w}/{split}"):
                prefix = torch.stack([s[o:o + hp.prefix_len] for o in offs[i:i + hp.gen_batch].tolist()])
                ids = torch.cat([prefix, greedy(model, prefix, hp.cont_len)], 1)
                seqs.append(ids)
                auxs.append(aux_states(model, ids, hp.target_layer_ids).to(torch.float16))
            atomic_save({"ids": torch.cat(seqs).to(torch.int16), "aux": torch.cat(auxs),
                         "prefix_len": hp.prefix_len}, path)
            log.log("continuations", workload=w, split=split, seqs=count, tokens=count * hp.cont_len)


# --------------------------------------------------------------------------
# DFlash2 drafter (docs/DESIGN.md 2.2)
# --------------------------------------------------------------------------
class ZeroRMSNorm(nn.Module):
    """The trunk's zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def rope_cos_sin(pos: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-head NeoX RoPE tables for integer positions of any shape -> [..., dim]."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    f = pos.float()[..., None] * inv
    emb = torch.cat((f, f), -1)
    return emb.cos(), emb.sin()


class GroupedDynConv(nn.Module):
    """docs/DESIGN.md 2.2 step 3: per-row dynamic kernels (one per group of channels)
    added to a static base kernel, causal along the block rows."""

    def __init__(self, hidden: int, taps: int, group: int) -> None:
        super().__init__()
        self.taps, self.group, self.groups = taps, group, hidden // group
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)  # start as the base kernel alone
        base = torch.zeros(2, taps, hidden)
        base[:, 0] = 1.0  # identity at init: tap 0 passes the row through
        self.base_kernel = nn.Parameter(base)

    def _conv(self, h: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
        # h [..., R, H]; dyn [..., R, taps, groups] (the OUTPUT row's kernels)
        k = self.base_kernel[side] + dyn.repeat_interleave(self.group, dim=-1)  # [..., R, taps, H]
        out = k[..., 0, :] * h
        for o in range(1, self.taps):
            shifted = F.pad(h, (0, 0, o, 0))[..., :h.shape[-2], :]  # h[t-o], zero before row 0
            out = out + k[..., o, :] * shifted
        return out

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dyn = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return self._conv(x, dyn[..., 0, :, :], 0), dyn[..., 1, :, :]

    def finish(self, y: torch.Tensor, dyn1: torch.Tensor) -> torch.Tensor:
        return self._conv(y, dyn1, 1)


class DraftAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.h, self.kvh, self.hd = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)  # plain: no gate half
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = ZeroRMSNorm(head_dim, eps)
        self.k_norm = ZeroRMSNorm(head_dim, eps)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """ctx [N, T, H] (fused aux states) -> k, v [N, T, kvh, hd]; k roped at its position."""
        k = self.k_norm(self.k_proj(ctx).unflatten(-1, (self.kvh, self.hd)))
        k = k * cos[:, :, None] + rotate_half(k) * sin[:, :, None]
        return k, self.v_proj(ctx).unflatten(-1, (self.kvh, self.hd))

    def forward(self, u: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, cmask: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """u [N, A, R, H] block rows; ck/cv [N, T, kvh, hd]; cmask [N, A, T] (visible
        context); cos/sin [N, A, R, hd] at the block positions."""
        rep = self.h // self.kvh
        q = self.q_norm(self.q_proj(u).unflatten(-1, (self.h, self.hd)))
        q = q * cos[..., None, :] + rotate_half(q) * sin[..., None, :]
        kb = self.k_norm(self.k_proj(u).unflatten(-1, (self.kvh, self.hd)))
        kb = kb * cos[..., None, :] + rotate_half(kb) * sin[..., None, :]
        vb = self.v_proj(u).unflatten(-1, (self.kvh, self.hd))
        ck, cv = ck.repeat_interleave(rep, 2), cv.repeat_interleave(rep, 2)  # head h reads kv h // rep
        kb, vb = kb.repeat_interleave(rep, 3), vb.repeat_interleave(rep, 3)
        scale = self.hd ** -0.5
        s_ctx = torch.einsum("narhd,nthd->nahrt", q, ck) * scale
        s_ctx = s_ctx.masked_fill(~cmask[:, :, None, None, :], float("-inf"))
        s_blk = torch.einsum("narhd,nashd->nahrs", q, kb) * scale  # bidirectional in the block
        p = torch.cat([s_ctx, s_blk], -1).float().softmax(-1)
        T = ck.shape[1]
        o = torch.einsum("nahrt,nthd->narhd", p[..., :T], cv) + torch.einsum("nahrs,nashd->narhd", p[..., T:], vb)
        return self.o_proj(o.flatten(-2))


class DraftMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, hp: HParams, eps: float) -> None:
        super().__init__()
        self.input_layernorm = ZeroRMSNorm(hp.hidden, eps)
        self.post_attention_layernorm = ZeroRMSNorm(hp.hidden, eps)
        self.self_attn = DraftAttention(hp.hidden, hp.heads, hp.kv_heads, hp.head_dim, eps)
        self.mlp = DraftMLP(hp.hidden, hp.intermediate)
        self.attention_conv = GroupedDynConv(hp.hidden, hp.conv_taps, hp.conv_group)
        self.mlp_conv = GroupedDynConv(hp.hidden, hp.conv_taps, hp.conv_group)

    def forward(self, x, ck, cv, cmask, cos, sin):
        u, d = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(u, ck, cv, cmask, cos, sin), d)
        u, d = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), d)


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, rank: int) -> None:
        super().__init__()
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)

    def scores(self, logits: torch.Tensor, final: torch.Tensor, pred: torch.Tensor,
               cand: torch.Tensor) -> torch.Tensor:
        """score_ij = logits_i[c_ij] + dot(pred_cb[pred_i] * proj_i, succ_cb[c_ij])."""
        proj = self.hidden_projection(final)
        q = self.predecessor_codebook[pred] * proj  # [..., rank]
        return logits.gather(-1, cand) + torch.einsum("...r,...kr->...k", q, self.successor_codebook[cand])


class DFlash2Drafter(nn.Module):
    """Differentiable DFlash2 forward over many blocks at once. Parameter names
    match the published drafter checkpoint (without the `dflash.` prefix). The
    trunk's embedding / lm_head (tied) are frozen buffers, not exported."""

    def __init__(self, hp: HParams, embed: torch.Tensor, mask_id: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hp, self.mask_id = hp, mask_id
        n_aux = len(hp.target_layer_ids)
        self.fc = nn.Linear(n_aux * hp.hidden, hp.hidden, bias=False)
        self.hidden_norm = ZeroRMSNorm(hp.hidden, eps)
        self.layers = nn.ModuleList([DraftLayer(hp, eps) for _ in range(hp.d_layers)])
        self.norm = ZeroRMSNorm(hp.hidden, eps)
        self.candidate_selector = CandidateSelector(hp.hidden, embed.shape[0], hp.selector_rank)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.weight.abs().sum() > 0:
                nn.init.normal_(m.weight, std=0.02)
        self.register_buffer("embed", embed.float(), persistent=False)

    def forward(self, ids: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor):
        """ids [N, T]; aux [N, T, n_aux*H]; anchors [N, A] positions.
        Returns logits [N, A, B, V] and final states [N, A, B, H] for rows 1..B."""
        hp = self.hp
        N, T = ids.shape
        B = hp.block_size
        ctx = self.hidden_norm(self.fc(aux.float()))
        tpos = torch.arange(T)
        ccos, csin = rope_cos_sin(tpos.expand(N, T), hp.head_dim, hp.rope_theta)
        # visible context for a block anchored at a: positions in [a - window, a)
        cmask = (tpos[None, None] < anchors[..., None]) & (tpos[None, None] >= anchors[..., None] - hp.sliding_window)
        rows = torch.full((N, anchors.shape[1], B + 1), self.mask_id, dtype=torch.long)
        rows[..., 0] = ids.gather(1, anchors)
        x = F.embedding(rows, self.embed)
        bcos, bsin = rope_cos_sin(anchors[..., None] + torch.arange(B + 1), hp.head_dim, hp.rope_theta)
        for layer in self.layers:
            ck, cv = layer.self_attn.context_kv(ctx, ccos, csin)
            x = layer(x, ck, cv, cmask, bcos, bsin)
        final = self.norm(x)[..., 1:, :]
        return final @ self.embed.T, final

    def export_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}


def load_cont(work: Path, split: str) -> dict[str, dict[str, torch.Tensor]]:
    return {w: torch.load(work / f"cont_{w}_{split}.pt") for w in WORKLOADS}


def block_targets(ids: torch.Tensor, anchors: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """targets [N, A, B] = ids[a+i] (the trunk's greedy tokens); valid where a+i < T."""
    T = ids.shape[1]
    pos = anchors[..., None] + torch.arange(1, B + 1)
    valid = pos < T
    return ids.gather(1, pos.clamp(max=T - 1).flatten(1)).view(pos.shape), valid


def drafter_loss(model: DFlash2Drafter, ids: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor,
                 hp: HParams) -> tuple[torch.Tensor, dict[str, float]]:
    logits, final = model(ids, aux, anchors)
    tgt, valid = block_targets(ids, anchors, hp.block_size)
    # DFlash positional weighting: early rows matter most for acceptance
    w = torch.exp(-torch.arange(hp.block_size, dtype=torch.float32) / hp.gamma).expand_as(tgt) * valid
    ce = F.cross_entropy(logits.flatten(0, 2), tgt.flatten(), reduction="none").view_as(tgt)
    loss_tok = (ce * w).sum() / w.sum()
    # selector: teacher-forced predecessors (anchor for row 1, then the truths)
    pred = torch.cat([ids.gather(1, anchors)[..., None], tgt[..., :-1]], -1)
    cand = logits.detach().topk(hp.selector_top_k, -1).indices
    hit = cand == tgt[..., None]
    present = hit.any(-1) & valid
    sc = model.candidate_selector.scores(logits, final, pred, cand)
    sce = F.cross_entropy(sc.flatten(0, 2), hit.float().argmax(-1).flatten(), reduction="none").view_as(tgt)
    ws = w * present
    loss_sel = (sce * ws).sum() / ws.sum().clamp(min=1)
    return loss_tok + loss_sel, {"tok": loss_tok.item(), "sel": loss_sel.item()}


@torch.no_grad()
def drafter_eval(model: DFlash2Drafter, data: dict[str, dict[str, torch.Tensor]], hp: HParams,
                 stride: int = 3) -> dict[str, Any]:
    """Per position i: top-1 accuracy of the logits (teacher-forced context),
    the greedy selector chain's accuracy, and the acceptance-style rate
    P(d_1..d_i all right) of the selector chain, on held-out continuations."""
    model.eval()
    res = {}
    for w, d in data.items():
        ids, aux, P = d["ids"].long(), d["aux"], d["prefix_len"]
        anchors = torch.arange(P - 1, ids.shape[1] - hp.block_size, stride)
        top1 = torch.zeros(hp.block_size)
        sel = torch.zeros(hp.block_size)
        acc_run = torch.zeros(hp.block_size)
        n = 0
        for i in range(0, len(ids), 16):
            x, a_ = ids[i:i + 16], aux[i:i + 16]
            an = anchors.expand(len(x), -1)
            logits, final = model(x, a_, an)
            tgt, _ = block_targets(x, an, hp.block_size)
            top1 += (logits.argmax(-1) == tgt).float().sum((0, 1))
            cand = logits.topk(hp.selector_top_k, -1).indices
            prev = x.gather(1, an)
            right = torch.ones_like(prev, dtype=torch.bool)
            for r in range(hp.block_size):  # greedy chain: pred_{i+1} = d_i
                s = model.candidate_selector.scores(logits[:, :, r], final[:, :, r], prev, cand[:, :, r])
                # ties resolve to the lower token id: sort candidates by id first
                order = cand[:, :, r].argsort(-1)
                best = s.gather(-1, order).argmax(-1, keepdim=True)
                dr = cand[:, :, r].gather(-1, order.gather(-1, best)).squeeze(-1)
                ok = dr == tgt[:, :, r]
                sel[r] += ok.float().sum()
                right &= ok
                acc_run[r] += right.float().sum()
                prev = dr
            n += an.numel()
        res[w] = {"top1": [round(v, 3) for v in (top1 / n).tolist()],
                  "selector": [round(v, 3) for v in (sel / n).tolist()],
                  "accept_prefix": [round(v, 3) for v in (acc_run / n).tolist()],
                  "mean_accepted_b8": round((acc_run / n).sum().item(), 3),
                  "mean_accepted_b2": round((acc_run[:2] / n).sum().item(), 3)}
    model.train()
    return res


def build_drafter(work: Path, hp: HParams, build: Path) -> DFlash2Drafter:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    trunk = load_trunk_hf(build / "tiny_hf")
    embed = trunk.model.embed_tokens.weight.detach().clone()
    set_seed(hp.seed + 1)
    return DFlash2Drafter(hp, embed, tok.token_to_id(MASK), eps=trunk.config.rms_norm_eps)


def train_drafter(work: Path, hp: HParams, build: Path, log: Logger, resume: bool) -> None:
    model = build_drafter(work, hp, build)
    params = [p for p in model.parameters() if p.requires_grad]
    log.log("drafter", params=sum(p.numel() for p in params))
    opt = make_optimizer(params, hp.d_lr, hp.weight_decay)
    ckpt_path = work / "drafter_ckpt.pt"
    step, elapsed = resume_checkpoint(ckpt_path, model, opt, log, "drafter") if resume else (0, 0.0)
    train, ev = load_cont(work, "train"), load_cont(work, "eval")
    budget = Budget(hp.drafter_steps, hp.drafter_minutes, elapsed)
    last_ckpt = last_eval = budget.now()
    bar = tqdm(desc="drafter", unit="step", initial=step, dynamic_ncols=True, mininterval=10)
    ema: dict[str, float] = {}
    tuner = ThreadTuner(torch.get_num_threads())
    model.train()
    while not budget.done(step):
        t_step = time.time()
        for g in opt.param_groups:
            g["lr"] = hp.d_lr * lr_factor(budget.progress(step), hp.warmup_frac, hp.min_lr_frac)
        gen = torch.Generator().manual_seed(hp.seed * 7_919 + step)
        w = WORKLOADS[step % len(WORKLOADS)]  # one workload per step, rotating: balanced
        d = train[w]
        idx = torch.randint(0, len(d["ids"]), (hp.d_batch_seqs,), generator=gen)
        ids, aux, P = d["ids"][idx].long(), d["aux"][idx], d["prefix_len"]
        # anchors from the last prefix token on, so every target is a greedy token
        anchors = torch.randint(P - 1, ids.shape[1] - 1, (hp.d_batch_seqs, hp.d_anchors), generator=gen)
        loss, parts = drafter_loss(model, ids, aux, anchors, hp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tuner.record(time.time() - t_step)
        ema[w] = parts["tok"] if w not in ema else 0.95 * ema[w] + 0.05 * parts["tok"]
        bar.update(1)
        bar.set_postfix(tok=f"{parts['tok']:.3f}", sel=f"{parts['sel']:.3f}")
        now = budget.now()
        if now - last_eval > hp.eval_minutes * 60:
            last_eval = now
            log.log("drafter", step=step, elapsed_min=round(now / 60, 1),
                    train_tok_loss={k: round(v, 4) for k, v in ema.items()}, eval=drafter_eval(model, ev, hp, 9))
        if now - last_ckpt > hp.ckpt_minutes * 60:
            last_ckpt = now
            atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": now},
                        ckpt_path)
    bar.close()
    now = budget.now()
    atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": now}, ckpt_path)
    log.log("drafter", final=True, step=step, elapsed_min=round(now / 60, 1),
            train_tok_loss={k: round(v, 4) for k, v in ema.items()}, eval=drafter_eval(model, ev, hp))


def export_drafter(work: Path, hp: HParams, build: Path, log: Logger) -> None:
    from safetensors.torch import save_file

    model = build_drafter(work, hp, build)
    model.load_state_dict(torch.load(work / "drafter_ckpt.pt", weights_only=False)["model"])
    trunk_cfg = json.loads((build / "tiny_hf" / "config.json").read_text())
    out = build / "tiny_dflash"
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "dflash2",
        "hidden_size": hp.hidden,
        "num_hidden_layers": hp.d_layers,
        "num_attention_heads": hp.heads,
        "num_key_value_heads": hp.kv_heads,
        "head_dim": hp.head_dim,
        "intermediate_size": hp.intermediate,
        "rms_norm_eps": trunk_cfg.get("rms_norm_eps", 1e-6),
        "vocab_size": hp.vocab_size,
        "sliding_window": hp.sliding_window,
        "layer_types": ["sliding_attention"] * hp.d_layers,
        "is_causal": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": hp.rope_theta},
        "torch_dtype": "bfloat16",
        "dflash_config": {
            "block_size": hp.block_size,
            "mask_token_id": model.mask_id,
            "target_layer_ids": list(hp.target_layer_ids),
            "conv_kernel_size": hp.conv_taps,
            "conv_group_size": hp.conv_group,
            "selector_rank": hp.selector_rank,
            "selector_top_k": hp.selector_top_k,
        },
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = model.export_state()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    log.log("export", out=str(out), tensors=len(tensors),
            params=sum(t.numel() for t in tensors.values()))


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------
COMMANDS = """\
# every stage in order (each skipped when its output exists):
nice -n 10 python scripts/train_tiny.py --stage all --resume
# or stage by stage, as the shipped run did:
nice -n 10 python scripts/train_tiny.py --stage corpus
nice -n 10 python scripts/train_tiny.py --stage tokenizer
nice -n 10 python scripts/train_tiny.py --stage workloads
nohup nice -n 10 sh -c 'python scripts/train_tiny.py --stage trunk --resume && \\
  python scripts/train_tiny.py --stage continuations --threads 1 && \\
  python scripts/train_tiny.py --stage drafter --resume && \\
  python scripts/train_tiny.py --stage export' >> build/train.log 2>&1 &
nice -n 10 python scripts/train_tiny.py --stage report
# after a kill: the same commands; --resume continues trunk/drafter from
# build/tiny_work/{trunk,drafter}_ckpt.pt, continuations skip finished files.
# (--threads 1 for the decode loop: on a contended 2-core box its tiny ops
# straggle badly with 2 threads; trunk/drafter pick their count themselves.)
"""


def final_entry(work: Path, stage: str) -> dict[str, Any]:
    rows = [json.loads(l) for l in (work / "metrics.jsonl").read_text().splitlines() if l.strip()]
    finals = [r for r in rows if r.get("stage") == stage and r.get("final")]
    return finals[-1] if finals else {}


def write_report(work: Path, hp: HParams, build: Path, repo: Path, log: Logger) -> None:
    """build/TRAINING.md: sizes, data, time, losses, drafter accuracy, samples."""
    import yaml
    from safetensors import safe_open
    from tokenizers import Tokenizer

    def n_params(path: Path) -> int:
        with safe_open(str(path), "pt") as f:
            return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())

    tok = Tokenizer.from_file(str(build / "tiny_hf" / "tokenizer.json"))
    trunk, drafter = final_entry(work, "trunk"), final_entry(work, "drafter")
    lines = ["# tiny: training record", "",
             "Written by `scripts/train_tiny.py --stage report`. Hyper-parameters: "
             "`build/tiny_work/hparams.json`; every logged metric: `build/tiny_work/metrics.jsonl`.", "",
             "## Sizes", "",
             f"- trunk `build/tiny_hf/` (Qwen3_5ForCausalLM, bf16): {n_params(build / 'tiny_hf' / 'model.safetensors'):,} "
             f"parameters (tied embedding/lm_head counted once), vocab {tok.get_vocab_size()}",
             f"- drafter `build/tiny_dflash/` (DFlash2, 5 layers, bf16): "
             f"{n_params(build / 'tiny_dflash' / 'model.safetensors'):,} parameters (+ the trunk's shared embedding)",
             "", "## Data (tokens)", "", "| workload | train | eval (held out) |", "|---|---|---|"]
    for w in WORKLOADS:
        lines.append(f"| {w} | {len(load_tokens(work, w, 'train')):,} | {len(load_tokens(work, w, 'eval')):,} |")
    cont = hp.cont_train_per_workload * hp.cont_len
    lines += ["", f"Drafter data: per workload {hp.cont_train_per_workload} greedy continuations x {hp.cont_len} "
              f"tokens ({cont:,} tokens) after {hp.prefix_len}-token prefixes; eval: {hp.cont_eval_per_workload} "
              "per workload from held-out material.", "",
              "## Training", "",
              f"- trunk: {trunk.get('step')} steps of {hp.batch}x{hp.seq_len} tokens in {trunk.get('elapsed_min')} min "
              f"(~{(trunk.get('step') or 0) * hp.batch * hp.seq_len:,} tokens), AdamW lr {hp.lr}, cosine, warmup",
              f"- drafter: {drafter.get('step')} steps in {drafter.get('elapsed_min')} min, "
              f"{hp.d_batch_seqs} sequences x {hp.d_anchors} anchored blocks per step", "",
              "| workload | trunk train loss (EMA) | trunk val loss | drafter train CE (EMA) |", "|---|---|---|---|"]
    for w in WORKLOADS:
        lines.append(f"| {w} | {trunk.get('train_loss', {}).get(w)} | {trunk.get('val_loss', {}).get(w)} | "
                     f"{drafter.get('train_tok_loss', {}).get(w)} |")
    lines += ["", "## Drafter accuracy on held-out greedy continuations (per position 1..8)", "",
              "top1: argmax of the row's logits; selector: the greedy candidate-selector chain "
              "(docs/DESIGN.md 2.2 step 5); accept_prefix: P(d_1..d_i all equal the trunk's greedy tokens).", ""]
    for w, e in drafter.get("eval", {}).items():
        lines += [f"- **{w}**: top1 {e['top1']}", f"  selector {e['selector']}",
                  f"  accept_prefix {e['accept_prefix']}; accepted/round at block 8: "
                  f"{e['mean_accepted_b8']}, at block 2: {e['mean_accepted_b2']}"]
    lines += ["", "## Commands", "", "```sh", COMMANDS.rstrip(), "```", "", "## Sample greedy continuations", ""]
    model = load_trunk_hf(build / "tiny_hf")
    for w in WORKLOADS:
        prompt = yaml.safe_load((repo / "conf" / "workload" / f"{w}.yaml").read_text())["prompts"][0]
        ids = torch.tensor([tok.encode(prompt).ids])
        out = tok.decode(greedy(model, ids, 96)[0].tolist())
        lines += [f"### {w}", "", "```", prompt + "\u2588" + out, "```", "",]
    lines.append("(\u2588 marks where the prompt ends.)")
    (build / "TRAINING.md").write_text("\n".join(lines) + "\n")
    log.log("report", out=str(build / "TRAINING.md"))


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------
def stage_done(stage: str, work: Path, build: Path, repo: Path) -> bool:
    marks = {
        "corpus": work / "corpus" / "math_eval.json",
        "tokenizer": work / "tokens_math_eval.pt",
        "workloads": repo / "conf" / "workload" / "math.yaml",
        "trunk": build / "tiny_hf" / "model.safetensors",
        "continuations": work / "cont_math_train.pt",
        "drafter": work / "drafter_done",
        "export": build / "tiny_dflash" / "model.safetensors",
        "report": build / "TRAINING.md",
    }
    return marks[stage].exists()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="all", choices=(*STAGES, "all"))
    ap.add_argument("--build", type=Path, default=Path("build"))
    ap.add_argument("--resume", action="store_true", help="continue trunk/drafter from the last checkpoint")
    ap.add_argument("--force", action="store_true", help="rerun a stage whose output exists")
    ap.add_argument("--threads", type=int, default=2)
    for f in dataclasses.fields(HParams):  # every hyper-parameter is a flag
        if f.type in ("int", "float"):
            ap.add_argument("--" + f.name.replace("_", "-"), type=eval(f.type), default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    repo = Path(__file__).resolve().parent.parent
    build = args.build if args.build.is_absolute() else repo / args.build
    work = build / "tiny_work"
    work.mkdir(parents=True, exist_ok=True)
    log = Logger(work)
    hp_path = work / "hparams.json"
    hp = HParams()
    if hp_path.exists():  # a resumed/later stage keeps the recorded values
        rec = json.loads(hp_path.read_text())
        hp = HParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in rec.items()})
    for f in dataclasses.fields(HParams):
        v = getattr(args, f.name, None)
        if v is not None:
            setattr(hp, f.name, v)
    hp_path.write_text(json.dumps(dataclasses.asdict(hp), indent=2) + "\n")
    stages = STAGES if args.stage == "all" else (args.stage,)
    for st in stages:
        if args.stage == "all" and not args.force and stage_done(st, work, build, repo):
            # a stage interrupted mid-way has no completion mark and reruns (resuming if asked)
            tqdm.write(f"[{st}] done already, skipping")
            continue
        log.log(st, start=True, argv=sys.argv[1:])
        t0 = time.time()
        if st == "corpus":
            build_corpus(work, hp, log)
        elif st == "tokenizer":
            train_tokenizer(work, hp, log)
        elif st == "workloads":
            write_workloads(work, hp, repo, log)
        elif st == "trunk":
            train_trunk(work, hp, build, log, args.resume)
        elif st == "continuations":
            make_continuations(work, hp, build, log)
        elif st == "drafter":
            train_drafter(work, hp, build, log, args.resume)
            (work / "drafter_done").touch()
        elif st == "export":
            export_drafter(work, hp, build, log)
        elif st == "report":
            write_report(work, hp, build, repo, log)
        log.log(st, finished=True, seconds=round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
