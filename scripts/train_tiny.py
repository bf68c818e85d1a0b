#!/usr/bin/env python
"""Train the bundled `tiny` model: a small Qwen3.5 trunk, its DFlash2 drafter and its MTP head.

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
    install       build/tiny_hf repacked alone -> build/tiny_trunk
    prompts       the drafters' prompt mix -> build/tiny_prompts/{code,math,prose}.jsonl
    chat          chat turns from the training material -> build/tiny_chat/ (turbo.train --kind trunk)
    dflash2       python -m turbo.train build/tiny_trunk --kind dflash2 -> build/tiny_dflash2
    mtp           python -m turbo.train build/tiny_trunk --kind mtp -> build/tiny_mtp
    report        build/TRAINING.md (sizes, data, losses, held-out acceptance, samples)

The trunk trains in turbo.train.loop (its schedule, optimizer, checkpoints and resume);
the drafters are python -m turbo.train runs. scripts/build_tiny_install.sh files the trunk
and both into turbo/installs/tiny. ``--resume`` continues a killed ``trunk``, ``dflash2`` or
``mtp`` run from its last checkpoint. Learning-rate schedules follow the fraction of the
*time budget* spent (the CPUs are shared, so step rates vary); pass ``--trunk-steps`` for a
step-based schedule that is exactly reproducible.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import math
import random
import re
import sys
import sysconfig
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import turbo
from turbo.repack import repack
from turbo.train.__main__ import main as train_main
from turbo.train.loop import Schedule, train

WORKLOADS = ("prose", "code", "math")
EOS = "<|endoftext|>"
MASK = "<|mask|>"
STAGES = ("corpus", "tokenizer", "workloads", "trunk", "install", "prompts", "chat", "dflash2", "mtp", "report")


# --------------------------------------------------------------------------
# Hyper-parameters (all recorded to <work>/hparams.json)
# --------------------------------------------------------------------------
@dataclasses.dataclass
class HParams:
    seed: int = 1234
    vocab_size: int = 4096
    # trunk (its schedule and AdamW are turbo.train.loop's: 3% warmup, cosine to a tenth, decay 0.1)
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
    trunk_minutes: float = 55.0
    trunk_steps: int = 0  # 0 = time-budget schedule
    checkpoint_every: int = 100  # trunk steps
    eval_every: int = 500  # trunk steps between held-out losses
    # the drafters (python -m turbo.train; its defaults for the rest)
    drafter_examples: int = 600  # per workload
    target_layer_ids: tuple[int, ...] = (1, 3, 5, 6)
    drafter_minutes: float = 16.0
    mtp_minutes: float = 13.0


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def stable_hash(s: str) -> int:
    """A process-independent hash (Python's hash() is salted)."""
    return int(hashlib.sha1(s.encode()).hexdigest()[:8], 16)


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
WORKLOAD_NOTES = {"prose": "# Held-out prose prompts (scripts/train_tiny.py's held-out docstrings and help topics), "
                           "each cut\n# mid-sentence so that the model continues it: whole paragraphs ended at once "
                           "(end of text)."}


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
    # prose: the first few lines of held-out docstrings / help topics, cut mid-sentence: a whole
    # paragraph is where the model ends the text at once, and a generation of one token measures nothing
    prose = []
    for text in load_docs(work, "prose_eval"):
        lines = [l for l in text.splitlines()][:5]
        snippet = "\n".join(lines).rstrip()
        if 120 < len(snippet) < 400:
            prose.append(snippet[:int(len(snippet) * 0.85)].rsplit(" ", 1)[0])
    rng.shuffle(prose)
    prompts["prose"] = prose[:n]
    # math: held-out seed; the prompt stops after "Solution:" so the model works it
    prompts["math"] = [d.split("Solution:\n")[0] + "Solution:\n" for d in math_docs(hp.seed + 424_242, n)]
    out = repo / "conf" / "workload"
    out.mkdir(parents=True, exist_ok=True)
    for w in WORKLOADS:
        assert len(prompts[w]) >= 8, (w, len(prompts[w]))
        body = [WORKLOAD_NOTES.get(w, f"# Held-out {w} prompts written by scripts/train_tiny.py (not in the training "
                                      "data)."), f"name: {w}", "max_new_tokens: 256", "prompts:"]
        body += [f"  - {json.dumps(p)}" for p in prompts[w]]  # JSON strings are valid YAML
        (out / f"{w}.yaml").write_text("\n".join(body) + "\n")
        log.log("workloads", workload=w, prompts=len(prompts[w]))


# --------------------------------------------------------------------------
# The drafters' prompt mix: several phrasings per workload, from training material only.
# The held-out prompts (docs/tiny_heldout/*.jsonl, written by hand) use none of these phrasings.
# --------------------------------------------------------------------------
MATH_FRAMES = ("Problem: {q}\nSolution:\n", "Q: {q}\nA:", "Question: {q}\nAnswer:", "{q}\nSolution:\n",
               "Solve: {q}\n", "Math: {q}\n", "Problem {n}. {q}\nSolution:\n", "{q}\nLet's think step by step.\n",
               "Puzzle: {q}\nExplanation:\n", "Quiz {n}: {q}\n", "Practice: {q}\nAnswer:\n", "{q}\n")
EXPR_ASKS = ("Compute {e}.", "What is {e}?", "Calculate {e}.", "Work out {e}.")
CODE_FRAMES = ("{head}", "# {doc}\n{sig}\n", "{sig}\n    \"\"\"{doc}\"\"\"\n", "Instruction: {doc}\nCode:\n{sig}\n",
               "Write a Python function that {doc_lc}\n{sig}\n", "```python\n{head}", "# {doc}\n", "{comment}")
PROSE_FRAMES = ("{head}", "{comment}", "Explain {name}:\n", "{name}: {first}", "Summary of {name}.\n{first}",
                "Documentation for {name}\n\n", "Q: What does {name} do?\nA:", "{first}")


def math_question(rng: random.Random) -> str:
    """A generated problem's question, asked in one of several ways."""
    q = math_problem(rng).split("\nSolution:")[0].removeprefix("Problem: ")
    if q.startswith("Compute "):
        q = rng.choice(EXPR_ASKS).format(e=q.removeprefix("Compute ").removesuffix("."))
    return q


def code_parts(text: str, rng: random.Random) -> dict[str, str] | None:
    """A function of a training file: its head, signature, docstring's first line and a comment run."""
    lines = text.splitlines()
    starts = [i for i, l in enumerate(lines) if l.lstrip().startswith("def ") and l.rstrip().endswith(":")]
    if not starts:
        return None
    documented = [i for i in starts if i + 1 < len(lines) and lines[i + 1].strip().startswith(('"""', "'''"))]
    i = rng.choice(documented or starts)
    sig = lines[i].strip()
    body = [l.strip() for l in lines[i + 1:i + 4]]
    doc = ""
    if body and body[0].startswith(('"""', "'''")):
        doc = (body[0][3:] or (body[1] if len(body) > 1 else "")).strip('"\' ')
    doc = doc if len(doc) > 12 else f"does what {sig[4:sig.find('(')]} does"
    comments = comment_blocks(text)
    return {"head": "\n".join(lines[i:i + 6]).rstrip() + "\n", "sig": sig, "doc": doc,
            "doc_lc": doc[0].lower() + doc[1:], "comment": rng.choice(comments) if comments else f"# {doc}\n"}


def prose_parts(text: str) -> dict[str, str]:
    lines = text.strip().splitlines()
    name = lines[0].strip() if len(lines[0]) < 60 else "this module"
    body = " ".join(l.strip() for l in lines[1:] if l.strip()) or lines[0]
    first = body.split(". ")[0].rstrip(".") + ". "
    return {"head": "\n".join(lines[:5]).rstrip() + "\n", "name": name, "first": first,
            "comment": (body[:300].rsplit(" ", 1)[0] + " ")}


def write_prompts(work: Path, hp: HParams, build: Path, log: Logger, n: int = 3000) -> None:
    """build/tiny_prompts/{code,math,prose}.jsonl: n prompts each, the phrasings in turn."""
    rng = random.Random(hp.seed + 55)
    out = build / "tiny_prompts"
    out.mkdir(parents=True, exist_ok=True)
    code_docs, prose_docs = load_docs(work, "code_train"), load_docs(work, "prose_train")
    made: dict[str, list[str]] = {"math": [], "code": [], "prose": []}
    while len(made["math"]) < n:
        frame = MATH_FRAMES[len(made["math"]) % len(MATH_FRAMES)]
        made["math"].append(frame.format(q=math_question(rng), n=rng.randint(1, 40)))
    while len(made["code"]) < n:
        parts = code_parts(rng.choice(code_docs), rng)
        if parts is not None:
            made["code"].append(CODE_FRAMES[len(made["code"]) % len(CODE_FRAMES)].format(**parts))
    while len(made["prose"]) < n:
        doc = rng.choice(prose_docs)
        if len(doc) > 120:
            made["prose"].append(PROSE_FRAMES[len(made["prose"]) % len(PROSE_FRAMES)].format(**prose_parts(doc)))
    for w, items in made.items():
        (out / f"{w}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in items))
        log.log("prompts", workload=w, prompts=len(items))


# --------------------------------------------------------------------------
# Chat turns (the trunk's chat fine-tune: python -m turbo.train --kind trunk, docs/tiny.md)
# --------------------------------------------------------------------------
CHAT_TEMPLATE = Path(__file__).resolve().parent.parent / "turbo" / "installs" / "tiny" / "chat_template.jinja"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")
SYSTEMS = ("You are turbo-tiny, a small model trained on Python's standard library.", "Be brief.",
           "You answer questions about Python.")
PROSE_ASKS = ("Explain {name}.", "What does {name} do?", "Tell me about {name}.", "What is {name}?")
TOPIC_ASKS = ("Explain {name}.", "Tell me about {name}.", "What is {name}?")
CODE_ASKS = ("Write a Python function that {doc}", "Write a function that {doc}",
             "Implement {fn} in Python: it {doc}")


def chat_prose(doc: str, rng: random.Random) -> tuple[str, str, str] | None:
    """(question, reasoning, answer) from a docstring ("module.name\n\ntext") or a help topic."""
    title, _, body = doc.strip().partition("\n")
    body = body.strip().lstrip("*=-").strip()
    if len(title) > 60 or len(body) < 80:
        return None
    asks = PROSE_ASKS if re.fullmatch(r"[\w.]+", title) else TOPIC_ASKS
    answer = body[:700].rsplit("\n\n", 1)[0] if len(body) > 700 else body
    return rng.choice(asks).format(name=title), f"The question is about {title}. I recall its documentation.", answer


def chat_code(source: str, rng: random.Random) -> list[tuple[str, str, str]]:
    """(request, reasoning, answer) for each short documented function of a source file."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out, lines = [], source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node) or ""
        first = doc.strip().split("\n\n")[0].replace("\n", " ")
        if not 20 < len(first) < 160 or node.end_lineno - node.lineno > 30:
            continue
        text = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        doc_lc = first[0].lower() + first[1:]
        ask = rng.choice(CODE_ASKS).format(doc=doc_lc, fn=node.name)
        out.append((ask, f"I need a function that {doc_lc} I will call it {node.name}.",
                    f"```python\n{text}\n```"))
    return out


def chat_math(rng: random.Random) -> tuple[str, str, str]:
    """(problem, worked steps, answer) of a generated problem."""
    problem = math_problem(rng)
    q, _, rest = problem.partition("\nSolution:\n")
    steps, _, answer = rest.strip().rpartition("\nAnswer: ")
    q = q.removeprefix("Problem: ")
    if q.startswith("Compute "):
        q = rng.choice(EXPR_ASKS).format(e=q.removeprefix("Compute ").removesuffix("."))
    return q, steps, f"The answer is {answer}."


def chat_record(rng: random.Random, ask: str, reasoning: str, answer: str) -> dict:
    """One conversation: an optional system prompt, the turn, thinking on or off at random."""
    thinking = rng.random() < 0.5
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    messages += [{"role": "user", "content": ask},
                 {"role": "assistant", "content": answer, "reasoning_content": reasoning if thinking else ""}]
    return {"messages": messages, "enable_thinking": thinking}


def write_chat(work: Path, hp: HParams, build: Path, log: Logger, n: int = 4000) -> None:
    """build/tiny_chat/: chat_{prose,code,math}.jsonl (n conversations each, from the training
    material only), raw.jsonl (training documents, so raw completion is kept), and
    prompts_{prose,code,math}.jsonl (rendered generation prompts: the drafters' fine-tune)."""
    from turbo.chat.template import render

    rng = random.Random(hp.seed + 77)
    out = build / "tiny_chat"
    out.mkdir(parents=True, exist_ok=True)
    code_docs, prose_docs = load_docs(work, "code_train"), load_docs(work, "prose_train")
    made: dict[str, list[dict]] = {"prose": [], "code": [], "math": []}
    while len(made["prose"]) < n:
        turn = chat_prose(rng.choice(prose_docs), rng)
        if turn:
            made["prose"].append(chat_record(rng, *turn))
    functions = [t for doc in code_docs for t in chat_code(doc, rng)]  # (parsed once: ~20 s)
    while len(made["code"]) < n:
        made["code"].append(chat_record(rng, *rng.choice(functions)))
    while len(made["math"]) < n:
        made["math"].append(chat_record(rng, *chat_math(rng)))
    template = CHAT_TEMPLATE.read_text()
    for w, items in made.items():
        (out / f"chat_{w}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
        prompts = [render(template, r["messages"][:-1], add_generation_prompt=True,
                          enable_thinking=r["enable_thinking"]) for r in items[:1000]]
        (out / f"prompts_{w}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
        log.log("chat", workload=w, conversations=len(items))
    raw = (rng.sample(load_docs(work, "code_train"), 300) + rng.sample(prose_docs, 1500)
           + load_docs(work, "math_train")[:1500])
    (out / "raw.jsonl").write_text("".join(json.dumps(d) + "\n" for d in raw))
    log.log("chat", raw_documents=len(raw))


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


def sample_batch(streams: dict[str, torch.Tensor], hp: HParams, step: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, list[str]]:
    """A balanced batch (workloads rotate), drawn with the loop's generator for the step
    (seeded with (seed, step)), so a resumed run sees the same data it would have seen."""
    rows, names = [], []
    for b in range(hp.batch):
        w = WORKLOADS[(b + step) % len(WORKLOADS)]
        s = streams[w]
        off = int(torch.randint(0, len(s) - hp.seq_len - 1, (1,), generator=gen))
        rows.append(s[off:off + hp.seq_len + 1])
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

def running_losses(log_path: Path) -> dict[str, float]:
    """Each workload's train loss as a running average (EMA 0.98) over the loop's log."""
    run: dict[str, float] = {}
    for line in log_path.read_text().splitlines():
        for w, v in json.loads(line).items():
            if w in WORKLOADS:
                run[w] = v if w not in run else 0.98 * run[w] + 0.02 * v
    return {w: round(v, 4) for w, v in run.items()}


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
    """turbo.train.loop over a fresh Qwen3_5ForCausalLM: next-token cross entropy on balanced
    batches; its checkpoint and per-step log in <work>/trunk/, the held-out losses in metrics.jsonl."""
    from tokenizers import Tokenizer  # (optional heavy deps: only this stage needs them)
    from transformers import Qwen3_5ForCausalLM

    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    set_seed(hp.seed)
    model = Qwen3_5ForCausalLM(trunk_config(hp, tok.token_to_id(EOS))).float()
    log.log("trunk", params=sum(p.numel() for p in model.parameters()), seq_len=hp.seq_len, batch=hp.batch)
    streams = {w: load_tokens(work, w, "train") for w in WORKLOADS}
    ev = eval_windows({w: load_tokens(work, w, "eval") for w in WORKLOADS}, hp.seq_len, 16)

    def step_loss(step: int, gen: torch.Generator) -> tuple[torch.Tensor, dict, int]:
        if step and step % hp.eval_every == 0:
            log.log("trunk", step=step, val_loss=val_losses(model, ev))
        x, names = sample_batch(streams, hp, step, gen)
        logits = model(input_ids=x[:, :-1]).logits
        per_tok = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(len(x), -1)
        per_seq = per_tok.detach().mean(1)
        parts = {w: per_seq[[i for i, n in enumerate(names) if n == w]].mean().item() for w in WORKLOADS if w in names}
        loss = per_tok.mean()
        return loss, {"loss": loss.item(), **parts}, x[:, 1:].numel()

    loop_dir = work / "trunk"
    loop_dir.mkdir(exist_ok=True)
    by_steps = hp.trunk_steps > 0
    sched = Schedule(hp.lr, hp.trunk_steps if by_steps else None, None if by_steps else hp.trunk_minutes,
                     hp.checkpoint_every, hp.seed)
    steps = train(model, step_loss, sched, loop_dir, resume)
    elapsed = torch.load(loop_dir / "checkpoint.pt", weights_only=True)["elapsed"]
    log.log("trunk", final=True, step=steps, elapsed_min=round(elapsed / 60, 1),
            train_loss=running_losses(loop_dir / "log.jsonl"), val_loss=val_losses(model, ev))
    save_trunk_hf(model, work, build / "tiny_hf")
    log.log("trunk", saved=str(build / "tiny_hf"))


# --------------------------------------------------------------------------
# The drafters: python -m turbo.train on the trunk's install
# --------------------------------------------------------------------------
def build_trunk_install(build: Path) -> None:
    """build/tiny_trunk: the trunk alone, repacked as an install (what the drafters train for)."""
    repack(build / "tiny_hf", build / "tiny_trunk", quiet=True)


def drafter_command(kind: str, hp: HParams, build: Path, repo: Path) -> list[str]:
    """python -m turbo.train's arguments for the shipped drafter (`kind` dflash2) or MTP head."""
    heldout = [str(repo / "docs" / "tiny_heldout" / f"{w}.jsonl") for w in ("code", "math", "prose")]
    args = [str(build / "tiny_trunk"), "--kind", kind,
            "--data", *(str(build / "tiny_prompts" / f"{w}.jsonl") for w in ("code", "math", "prose")),
            "--heldout", *heldout, "--out", str(build / f"tiny_{kind}"), "--examples", str(hp.drafter_examples),
            "--prompt-tokens", "128", "--new-tokens", "96", "--device", "cpu", "--threads", "1",
            "--checkpoint-every", "200", "--seed", "0"]
    if kind == "dflash2":
        return args + ["--target-layers", *map(str, hp.target_layer_ids), "--minutes", str(hp.drafter_minutes)]
    return args + ["--minutes", str(hp.mtp_minutes)]


def train_drafter(kind: str, hp: HParams, build: Path, repo: Path, resume: bool) -> None:
    resumable = resume and (build / f"tiny_{kind}" / "train" / "run.json").is_file()
    code = train_main(drafter_command(kind, hp, build, repo) + (["--resume"] if resumable else []))
    if code:
        sys.exit(code)


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------
COMMANDS = """\
# every stage in order (each skipped when its output exists):
nice -n 10 python -m scripts.train_tiny --stage all --resume
# or stage by stage, as the shipped run did:
nice -n 10 python -m scripts.train_tiny --stage corpus
nice -n 10 python -m scripts.train_tiny --stage tokenizer
nice -n 10 python -m scripts.train_tiny --stage workloads
nohup nice -n 10 sh -c 'python -m scripts.train_tiny --stage trunk --resume && \\
  python -m scripts.train_tiny --stage install && \\
  python -m scripts.train_tiny --stage prompts && \\
  python -m scripts.train_tiny --stage dflash2 --resume && \\
  python -m scripts.train_tiny --stage mtp --resume' >> build/train.log 2>&1 &
sh scripts/build_tiny_install.sh
nice -n 10 python -m scripts.train_tiny --stage report
# after a kill: the same commands; --resume continues the trunk from
# build/tiny_work/trunk/checkpoint.pt and the drafters from build/tiny_{dflash2,mtp}/train/.
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
    trunk = final_entry(work, "trunk")
    lines = ["# tiny: training record", "",
             "Written by `python -m scripts.train_tiny --stage report`. Hyper-parameters: "
             "`build/tiny_work/hparams.json`; every logged metric: `build/tiny_work/metrics.jsonl` and "
             "`build/tiny_work/trunk/log.jsonl` (trunk), "
             "`build/tiny_{dflash2,mtp}/train/log.jsonl` (the drafters).", "",
             "## Sizes", "",
             f"- trunk `build/tiny_hf/` (Qwen3_5ForCausalLM, bf16): {n_params(build / 'tiny_hf' / 'model.safetensors'):,} "
             f"parameters (tied embedding/lm_head counted once), vocab {tok.get_vocab_size()}",
             f"- drafter `build/tiny_dflash2/` (DFlash2, 5 layers, bf16): "
             f"{n_params(build / 'tiny_dflash2' / 'model.safetensors'):,} parameters (+ the trunk's shared embedding)",
             f"- MTP head `build/tiny_mtp/` (bf16): {n_params(build / 'tiny_mtp' / 'model.safetensors'):,} parameters",
             "", "## Data (tokens)", "", "| workload | train | eval (held out) |", "|---|---|---|"]
    for w in WORKLOADS:
        lines.append(f"| {w} | {len(load_tokens(work, w, 'train')):,} | {len(load_tokens(work, w, 'eval')):,} |")
    lines += ["", "## Training", "",
              f"- trunk: {trunk.get('step')} steps of {hp.batch}x{hp.seq_len} tokens in {trunk.get('elapsed_min')} min "
              f"(~{(trunk.get('step') or 0) * hp.batch * hp.seq_len:,} tokens), AdamW lr {hp.lr}, cosine, warmup", "",
              "| workload | trunk train loss (EMA) | trunk val loss |", "|---|---|---|"]
    for w in WORKLOADS:
        lines.append(f"| {w} | {trunk.get('train_loss', {}).get(w)} | {trunk.get('val_loss', {}).get(w)} |")
    for kind in ("dflash2", "mtp"):
        run = json.loads((build / f"tiny_{kind}" / "train" / "run.json").read_text())
        ev = json.loads((build / f"tiny_{kind}" / "eval.json").read_text())
        blocks = next(iter(ev["groups"].values()))["blocks"]
        lines += ["", f"## {kind}: `python -m turbo.train {' '.join(drafter_command(kind, hp, build, repo)[1:])}`", "",
                  f"{run['steps']} steps on {run['examples']} greedy continuations of build/tiny_prompts; held out "
                  "(docs/tiny_heldout, stopped at end of text), accepted per round:", "",
                  "| workload | " + " | ".join(f"block {b}" for b in blocks) + " |", "|---" * (1 + len(blocks)) + "|"]
        for w, g in ev["groups"].items():
            cells = " | ".join(f"{r['accepted_per_round']:.2f}" for r in g["blocks"].values())
            lines.append(f"| {w} | {cells} |")
    lines += ["", "## Commands", "", "```sh", COMMANDS.rstrip(), "```", "", "## Sample greedy continuations", ""]
    rt = turbo.open(str(build / "tiny_trunk"), backend="cpu")
    for w in WORKLOADS:
        prompt = yaml.safe_load((repo / "conf" / "workload" / f"{w}.yaml").read_text())["prompts"][0]
        out = tok.decode(rt.generate(prompt, max_new_tokens=96, policy="off", stop_at_eos=False).tokens)
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
        "prompts": build / "tiny_prompts" / "math.jsonl",
        "chat": build / "tiny_chat" / "raw.jsonl",
        "trunk": build / "tiny_hf" / "model.safetensors",
        "install": build / "tiny_trunk" / "model.safetensors",
        "dflash2": build / "tiny_dflash2" / "eval.json",
        "mtp": build / "tiny_mtp" / "eval.json",
        "report": build / "TRAINING.md",
    }
    return marks[stage].exists()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default="all", choices=(*STAGES, "all"))
    ap.add_argument("--build", type=Path, default=Path("build"))
    ap.add_argument("--resume", action="store_true", help="continue trunk, dflash2, mtp from the last checkpoint")
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
        known = {f.name for f in dataclasses.fields(HParams)}  # (a record from before a field was dropped)
        hp = HParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in rec.items() if k in known})
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
        elif st == "install":
            build_trunk_install(build)
        elif st == "prompts":
            write_prompts(work, hp, build, log)
        elif st == "chat":
            write_chat(work, hp, build, log)
        elif st in ("dflash2", "mtp"):
            train_drafter(st, hp, build, repo, args.resume)
        elif st == "report":
            write_report(work, hp, build, repo, log)
        log.log(st, finished=True, seconds=round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
