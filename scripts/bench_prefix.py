"""A multi-user chat workload against `python -m turbo task=serve` (this tree's; another
checkout's with --vs DIR) and llama.cpp's `llama-server --parallel N` (--llamacpp): many users
sharing one long system prompt and tools block, each asking their own questions over several
turns, the way an agent or a support bot is served. What it shows is how much of that shared
prefix each server prefills once rather than per user.

    python -m scripts.bench_prefix [--install qwen3.5-0.8b] [--users 16] [--turns 3] [--concurrency 4] \\
        [--shared-tokens 2000] [--max-tokens 32] [--reps 1] [--check 8] [--vs DIR] [--llamacpp]
    python -m scripts.bench_prefix --install tiny --users 3 --turns 2 --shared-tokens 300   # a smoke run

The workload (deterministic, --seed): a system message and up to --tools tool JSON schemas,
rendered by the install's chat template (the shipped tiny's where the install has none) to
--shared-tokens tokens of its tokenizer; each user's questions are --question-tokens MIN MAX
tokens long; each turn resends the conversation with the previous answer, as a chat client does,
greedy, --max-tokens per answer, streamed through the `openai` client with usage included.
Users start in order while fewer than --concurrency are in flight -- the first ones one after
another, each once the one before has its first token (a server that has been up has seen its
system prompt; users arriving in the same instant measure only a cold start) -- and a new one
whenever one finishes its turns.

Per system and repetition (each repetition starts every server afresh, so no repetition finds
another's conversations cached; systems interleaved, each load under benchlib's quiet-machine
guard): the hit rate in tokens (cached_tokens over prompt tokens; and over the shared prefix,
sum of min(cached, shared) over shared x requests), TTFT p50 / p99 (to the first chunk carrying
text, reasoning or a tool call), TTFT p50 of turn 1 of users 2..N (the issue's goal: >= 5x
lower than the old server's), prefill tokens (prompt minus cached; llama-server's
`timings.prompt_n`, what it processed), generated tokens/s. --check N: N of the first repetition's turbo requests (those the
cache served first) replayed one at a time on the same command with serve.cache_gb=0, the
answers equal or the run stops. The table goes to stdout, every record (JSON lines) to
docs/results/prefix-DATE.jsonl. A benchmark, not a test: time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import openai
from tokenizers import Tokenizer

from scripts import benchlib
from scripts.llamacpp_server import start_llama_server
from scripts.load import percentile
from turbo.chat.template import ChatTemplate, encode, install_template
from turbo.store.install import open_install
from turbo.testing import shapes
from turbo.testing.checks import served_address

ROOT = Path(__file__).resolve().parents[1]
TINY_TEMPLATE = ROOT / "turbo" / "installs" / "tiny" / "chat_template.jinja"

# the workload's words: a support bot's system text and its users' questions
SYSTEM_SENTENCES = [
    "You are the support assistant of Northwind Garden Supply, a shop that sells tools, seeds and soil.",
    "Answer in short plain sentences and never invent an order number, a price or a delivery date.",
    "When a customer asks about an order, look it up with the tools before you answer.",
    "Refunds are possible within thirty days of delivery for unused items in their original packaging.",
    "Seeds and live plants cannot be returned, but a damaged delivery is always replaced free of charge.",
    "Opening hours are eight to six on weekdays and nine to four on Saturdays; the shop is closed on Sundays.",
    "Escalate to a human agent when the customer is angry, asks for a manager, or mentions a safety problem.",
    "Do not discuss competitors, politics or anything unrelated to gardening and the customer's orders.",
    "Quote the customer's own words when you confirm what they asked for, so that nothing is misunderstood.",
    "Prices include tax; shipping is free above fifty euros and costs four euros ninety below that.",
]
TOPICS = ["order", "delivery", "refund", "shovel", "seeds", "tomato", "compost", "hose", "invoice", "account",
          "password", "parcel", "rake", "soil", "fertiliser", "greenhouse", "discount", "voucher", "address", "pruner"]
WORDS = ["my", "the", "a", "it", "was", "is", "when", "why", "how", "can", "you", "please", "still", "not",
         "arrived", "broken", "late", "wrong", "again", "yesterday", "last", "week", "I", "ordered", "want",
         "to", "change", "cancel", "return", "know", "where", "which", "should", "use", "for", "garden"]


# ---- the workload ----------------------------------------------------------------------------


def tool_schema(i: int) -> dict:
    """The i-th tool: a function with a few typed, described parameters (as an agent's tools look)."""
    topic = TOPICS[i % len(TOPICS)]
    props = {f"{topic}_id": {"type": "string", "description": f"The {topic}'s identifier, as printed on it."},
             "customer_email": {"type": "string", "description": "The customer's e-mail address."},
             "limit": {"type": "integer", "description": "At most this many results.", "minimum": 1},
             "include_history": {"type": "boolean", "description": f"Also list the {topic}'s earlier changes."}}
    return {"type": "function",
            "function": {"name": f"lookup_{topic}_{i}", "description": f"Look up a {topic} and what is known about it.",
                         "parameters": {"type": "object", "properties": props, "required": [f"{topic}_id"]}}}


@dataclass
class Workload:
    system: str
    tools: list[dict]
    questions: list[list[str]]  # per user, per turn
    shared: int  # tokens every user's first prompt begins with (the rendered system and tools block)
    template_file: Path | None  # a template to serve with (None: the install's own)


def build_workload(install: Path, args) -> Workload:
    """The shared block grown to --shared-tokens (tools first, up to --tools within ~half of it,
    then system sentences), and each user's questions, all counted with the install's tokenizer
    over its template's rendering."""
    tokenizer = Tokenizer.from_file(str(install / "tokenizer.json"))
    inst = open_install(install)
    template_file = None if inst.chat_template is not None else TINY_TEMPLATE
    template = install_template(inst) if template_file is None else ChatTemplate(TINY_TEMPLATE.read_text(),
                                                                                 str(TINY_TEMPLATE))

    def count(system: str, tools: list[dict]) -> int:
        return len(encode(tokenizer, template.render([{"role": "system", "content": system}], tools=tools or None)))

    tools: list[dict] = []
    while len(tools) < args.tools and count("", tools + [tool_schema(len(tools))]) <= args.shared_tokens // 2:
        tools.append(tool_schema(len(tools)))
    system, i = "", 0
    while count(system, tools) < args.shared_tokens:
        system += (" " if system else "") + SYSTEM_SENTENCES[i % len(SYSTEM_SENTENCES)]
        i += 1
    rng = random.Random(args.seed)
    lo, hi = args.question_tokens
    questions = []
    for _ in range(args.users):
        turns = []
        for _ in range(args.turns):
            target, words = rng.randint(lo, hi), [rng.choice(TOPICS)]
            while len(tokenizer.encode(" ".join(words), add_special_tokens=False).ids) < target:
                words.append(rng.choice(WORDS + TOPICS))
            turns.append(" ".join(words) + "?")
        questions.append(turns)
    firsts = [encode(tokenizer, template.render([{"role": "system", "content": system},
                                                 {"role": "user", "content": q[0]}], tools=tools or None,
                                                add_generation_prompt=True)) for q in questions[:2]]
    shared = benchlib.first_divergence(*firsts) if len(firsts) == 2 else len(firsts[0])
    return Workload(system, tools, questions, shared if shared is not None else min(map(len, firsts)), template_file)


# ---- one request -----------------------------------------------------------------------------


@dataclass
class Answer:
    user: int
    turn: int
    messages: list[dict]
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish: str | None = None
    prompt_tokens: int = 0
    cached: int = 0
    cached_from: str | None = None  # turbo's usage.turbo.cached_from
    completion_tokens: int = 0
    prefill: int = 0
    ttft_s: float = 0.0

    def said(self) -> tuple:
        """What must equal the same request alone."""
        return self.content, self.reasoning, self.tool_calls, self.finish, self.completion_tokens


def ask(client: openai.OpenAI, model: str, work: Workload, user: int, turn: int, messages: list[dict],
        max_tokens: int, first: threading.Event | None = None) -> Answer:
    """One streamed greedy chat request; `first` is set at its first token."""
    a = Answer(user, turn, [dict(m) for m in messages])
    timings, start = None, time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages, tools=work.tools or openai.NOT_GIVEN,
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        timings = (chunk.model_extra or {}).get("timings") or timings  # llama-server's
        if chunk.usage is not None:
            u = chunk.usage
            a.prompt_tokens, a.completion_tokens = u.prompt_tokens, u.completion_tokens
            a.cached = (u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0
            a.cached_from = ((u.model_extra or {}).get("turbo") or {}).get("cached_from")
        for c in chunk.choices:
            d = c.delta
            reasoning = (d.model_extra or {}).get("reasoning_content") or ""
            if (d.content or reasoning or d.tool_calls) and not a.ttft_s:  # (a role-only chunk is no token)
                a.ttft_s = time.perf_counter() - start
                if first is not None:
                    first.set()
            a.content += d.content or ""
            a.reasoning += reasoning
            for call in d.tool_calls or []:
                while len(a.tool_calls) <= call.index:
                    a.tool_calls.append({"id": "", "name": "", "arguments": ""})
                got = a.tool_calls[call.index]
                got["id"] += call.id or ""
                got["name"] += (call.function.name or "") if call.function else ""
                got["arguments"] += (call.function.arguments or "") if call.function else ""
            a.finish = c.finish_reason or a.finish
    a.ttft_s = a.ttft_s or time.perf_counter() - start  # (an empty answer: its end)
    a.prefill = timings["prompt_n"] if timings and "prompt_n" in timings else a.prompt_tokens - a.cached
    return a


def reply(a: Answer) -> list[dict]:
    """The messages a chat client appends after an answer: the assistant's, and a result per tool call."""
    msg: dict = {"role": "assistant", "content": a.content}
    if not a.tool_calls:
        return [msg]
    msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                         for c in a.tool_calls]
    return [msg] + [{"role": "tool", "tool_call_id": c["id"], "content": '{"status": "ok"}'} for c in a.tool_calls]


def play(url: str, work: Workload, args) -> tuple[list[Answer], float]:
    """Every user's conversation, --concurrency of them at a time (the module's docstring): the
    answers in (user, turn) order and the wall time."""
    client = openai.OpenAI(base_url=f"http://{url}/v1", api_key="none", max_retries=0, timeout=args.timeout)
    model = client.models.list().data[0].id
    started = [threading.Event() for _ in work.questions]

    def converse(user: int) -> list[Answer]:
        if 0 < user < args.concurrency:  # the ramp: the user before has its first token
            started[user - 1].wait(args.timeout)
        messages = [{"role": "system", "content": work.system}]
        answers = []
        try:
            for turn, question in enumerate(work.questions[user]):
                messages.append({"role": "user", "content": question})
                a = ask(client, model, work, user, turn, messages, args.max_tokens,
                        started[user] if turn == 0 else None)
                answers.append(a)
                messages += reply(a)
        finally:  # (a user whose first request failed lets the next one start: the failure ends the load)
            started[user].set()
        return answers

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        done = list(pool.map(converse, range(len(work.questions))))
    return [a for answers in done for a in answers], time.perf_counter() - t0


def figures(answers: list[Answer], wall: float, shared: int) -> dict:
    """A load's figures (the module's docstring)."""
    ms = [a.ttft_s * 1e3 for a in answers]
    later_firsts = [a.ttft_s * 1e3 for a in answers if a.turn == 0 and a.user > 0]
    prompt, cached = sum(a.prompt_tokens for a in answers), sum(a.cached for a in answers)
    return {"requests": len(answers), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / max(prompt, 1),
            "shared_hit_rate": sum(min(a.cached, shared) for a in answers) / max(shared * len(answers), 1),
            "first_turn_hit_rate": (sum(a.cached for a in answers if a.turn == 0 and a.user > 0)
                                    / max(sum(a.prompt_tokens for a in answers if a.turn == 0 and a.user > 0), 1)),
            "ttft_p50_ms": percentile(ms, 50), "ttft_p99_ms": percentile(ms, 99),
            "first_turn_ttft_p50_ms": percentile(later_firsts, 50),
            "prefill_tokens": sum(a.prefill for a in answers),
            "completion_tokens": sum(a.completion_tokens for a in answers),
            "tokens_per_s": sum(a.completion_tokens for a in answers) / wall, "wall_s": wall,
            "cached_from": {k: sum(a.cached_from == k for a in answers) for k in {a.cached_from for a in answers}}}


# ---- the servers -----------------------------------------------------------------------------


@dataclass
class System:
    """How to start one system's server: turbo (`checkout`: the tree its turbo is imported from)
    or llama-server (`gguf`)."""

    name: str
    checkout: Path | None = None
    gguf: Path | None = None


def drain(proc: subprocess.Popen) -> None:
    """Read a server's pipes to their end (an access log line a request would fill a pipe nobody reads)."""
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            threading.Thread(target=pipe.read, daemon=True).start()


def start(system: System, install: str, work: Workload, args, cold: bool = False) -> tuple[subprocess.Popen, str]:
    """The system's server, answering: (its process, host:port). `cold`: turbo without a prefix cache."""
    if system.gguf is not None:
        template = [] if work.template_file is None else ["--chat-template-file", str(work.template_file)]
        ctx = args.shared_tokens + args.turns * (args.question_tokens[1] + args.max_tokens + 64)
        extra = ["--jinja", *template, "--metrics", "--ctx-checkpoints", str(args.ctx_checkpoints),
                 "--checkpoint-min-step", str(args.checkpoint_min_step), "--cache-ram", str(args.cache_ram)]
        proc, url = start_llama_server(str(system.gguf), args.threads, args.concurrency,
                                       ctx_per_slot=2 * ctx, extra=extra)  # (2x: its tokenizer's count may differ)
        return proc, url
    where = system.checkout or ROOT
    env = dict(os.environ, PYTHONPATH=str(where))
    cmd = [sys.executable, "-m", "turbo", "task=serve", "install=tiny" if install == "tiny" else f"install.path={install}",
           f"threads={args.threads}", "backend=cpu", "serve.port=0", "+policy=off",
           f"serve.max_running={args.concurrency}", f"serve.max_waiting={4 * args.concurrency}", "serve.memory_gb=8",
           *([f"serve.chat_template={work.template_file}"] if work.template_file is not None else []),
           *args.serve, *(["serve.cache_gb=0"] if cold else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=where, env=env)
    try:
        line = served_address(proc)
    except AssertionError as e:
        sys.exit(f"{system.name}: the server did not start: {e}")
    drain(proc)
    return proc, line.split("http://", 1)[1].split()[0]


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(2)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def gauges(url: str) -> dict:
    """turbo's prefix cache gauges from /metrics (an older server may have none: {})."""
    try:
        text = urllib.request.urlopen(f"http://{url}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    names = ("turbo:prefix_cache_bytes", "turbo:prefix_cache_entries")
    return {line.split("{")[0].split()[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith(names)}


def check(system: System, install: str, work: Workload, answers: list[Answer], args) -> int:
    """--check of the answers (the cache's hits first, spread over the users and turns) against
    the same requests one at a time on a server without a prefix cache; a mismatch ends the run."""
    hits, misses = [a for a in answers if a.cached], [a for a in answers if not a.cached]
    step = max(len(hits) // max(args.check, 1), 1)
    chosen = (hits[::step] + misses)[:args.check]
    if not chosen:
        return 0
    proc, url = start(system, install, work, args, cold=True)
    try:
        client = openai.OpenAI(base_url=f"http://{url}/v1", api_key="none", max_retries=0, timeout=args.timeout)
        model = client.models.list().data[0].id
        for a in chosen:
            alone = ask(client, model, work, a.user, a.turn, a.messages, args.max_tokens)
            if alone.said() != a.said():
                sys.exit(f"{system.name}: user {a.user + 1} turn {a.turn + 1} ({a.cached} of {a.prompt_tokens} prompt "
                         f"tokens cached, from {a.cached_from}) differs from the same request alone:\n"
                         f"  served: {a.said()!r}\n  alone:  {alone.said()!r}")
    finally:
        stop(proc)
    print(f"{system.name}: {len(chosen)} answers equal the same requests alone", file=sys.stderr)
    return len(chosen)


# ---- the run ---------------------------------------------------------------------------------


def med(xs: list[float], fmt: str = "{:.0f}") -> str:
    return fmt.format(statistics.median(xs)) + (f" ({fmt.format(min(xs))}..{fmt.format(max(xs))})" if len(xs) > 1 else "")


def table(systems: list[System], records: list[dict], checked: dict[str, int], work: Workload, args) -> None:
    print(f"{args.users} users x {args.turns} turns, {work.shared} shared prompt tokens ({len(work.tools)} tools), "
          f"questions {args.question_tokens[0]}-{args.question_tokens[1]} tokens, {args.max_tokens} tokens an answer, "
          f"{args.concurrency} in flight, {args.threads} threads; medians of the undisturbed of {args.reps} "
          f"interleaved repetitions (min..max)")
    print(benchlib.guard_summary(records))
    print("| system | hit rate, prompt / shared tokens | TTFT p50 / p99 ms | TTFT p50 ms, turn 1 of users 2.."
          f"{args.users} | prefill tokens | tokens/s | answers = alone |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    firsts = {}
    for s in systems:
        fs = [r for r in benchlib.kept(records) if r["system"] == s.name]
        same = f"{checked[s.name]} / {checked[s.name]}" if s.name in checked else "-"
        if not fs:
            print(f"| {s.name} | - (every repetition disturbed) | | | | | {same} |")
            continue
        firsts[s.name] = statistics.median(f["first_turn_ttft_p50_ms"] for f in fs)
        print(f"| {s.name} | {med([f['hit_rate'] * 100 for f in fs])}% / {med([f['shared_hit_rate'] * 100 for f in fs])}% "
              f"| {med([f['ttft_p50_ms'] for f in fs])} / {med([f['ttft_p99_ms'] for f in fs])} "
              f"| {med([f['first_turn_ttft_p50_ms'] for f in fs])} | {med([f['prefill_tokens'] for f in fs])} "
              f"| {med([f['tokens_per_s'] for f in fs], '{:.1f}')} | {same} |")
    if "turbo" in firsts and "turbo --vs" in firsts:
        print(f"\nturn 1 of users 2..{args.users}: TTFT p50 {firsts['turbo --vs'] / firsts['turbo']:.2f}x "
              "lower than --vs's (the issue's goal: >= 5x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--install", default="qwen3.5-0.8b",
                    help=f"`tiny` (the shipped install), a shape ({', '.join(shapes.SHAPES)}) or an install directory")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--shared-tokens", type=int, default=2000, help="the system prompt and tools block's tokens")
    ap.add_argument("--tools", type=int, default=20, help="at most this many tool schemas in the shared block")
    ap.add_argument("--question-tokens", type=int, nargs=2, default=[20, 200], metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--check", type=int, default=8, help="turbo answers checked against the request alone (0: none)")
    ap.add_argument("--vs", type=Path, metavar="DIR", help="also the server of the checkout at DIR (its turbo)")
    ap.add_argument("--llamacpp", action="store_true", help="also llama-server --parallel CONCURRENCY on the shape's GGUF")
    ap.add_argument("--gguf", default="bf16", help="--llamacpp: the shape's GGUF kind (bf16, q8_0, q4_0)")
    # llama-server's context checkpoints (its PR 15293: a recurrent state cannot be rolled back, so a
    # slot keeps copies at the last user message's start and before the prompt's end): its default
    # count; its default spacing (8192 tokens) would keep no earlier turn of a 2,000-token conversation
    ap.add_argument("--ctx-checkpoints", type=int, default=32, help="llama-server's --ctx-checkpoints (per slot)")
    ap.add_argument("--checkpoint-min-step", type=int, default=256, help="llama-server's --checkpoint-min-step")
    ap.add_argument("--cache-ram", type=int, default=8192, help="llama-server's --cache-ram (MiB)")
    ap.add_argument("--serve", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for turbo's servers")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    ap.add_argument("--out", type=Path, help="the records (JSON lines; default docs/results/prefix-DATE.jsonl)")
    args = ap.parse_args()
    if min(args.users, args.turns, args.concurrency, args.shared_tokens, args.max_tokens, args.reps) < 1:
        sys.exit("error: --users, --turns, --concurrency, --shared-tokens, --max-tokens and --reps must be positive")
    if not 1 <= args.question_tokens[0] <= args.question_tokens[1]:
        sys.exit(f"error: --question-tokens {args.question_tokens}: expected 1 <= MIN <= MAX")
    if args.vs is not None and not (args.vs / "turbo" / "__init__.py").is_file():
        sys.exit(f"error: --vs {args.vs}: not a checkout of turbo (expected {args.vs / 'turbo' / '__init__.py'})")
    if args.install == "tiny":
        install, path = "tiny", ROOT / "turbo" / "installs" / "tiny"
    elif args.install in shapes.SHAPES:
        install = str(shapes.build(args.install))
        path = Path(install)
    else:
        install, path = str(Path(args.install).resolve()), Path(args.install).resolve()
    systems = [System("turbo")] + ([System("turbo --vs", checkout=args.vs.resolve())] if args.vs else [])
    if args.llamacpp:
        if args.install not in shapes.SHAPES or args.install == "tiny":
            sys.exit(f"error: --llamacpp: --install {args.install}: expected a shape with a GGUF "
                     f"({', '.join(s for s in shapes.SHAPES if s != 'tiny')})")
        gguf = shapes.gguf(args.install, args.gguf)
        if gguf is None:
            sys.exit(f"error: --llamacpp: no {args.gguf} GGUF of {args.install} (turbo.testing.shapes.gguf; docs/llamacpp.md)")
        systems.append(System(f"llama-server --parallel {args.concurrency}, {args.gguf}", gguf=gguf))
    work = build_workload(path, args)
    print(f"workload: {work.shared} shared tokens ({len(work.tools)} tools), {args.users} users x {args.turns} turns",
          file=sys.stderr)
    out = args.out or benchlib.results_path("prefix")
    guard = benchlib.Guard.from_env(args.threads)
    records, checked = [], {}
    for rep in range(args.reps):
        for s in systems if rep % 2 == 0 else systems[::-1]:
            proc, url = start(s, install, work, args)
            try:
                with guard.rep(f"rep {rep} {s.name}") as g:
                    answers, wall = play(url, work, args)
                cache = gauges(url) if s.gguf is None else {}
            finally:
                stop(proc)
            rec = {"system": s.name, "rep": rep, **figures(answers, wall, work.shared), "metrics": cache,
                   "guard": dataclasses.asdict(g), "shared_tokens": work.shared, "tools": len(work.tools),
                   "args": vars(args) | {"vs": str(args.vs) if args.vs else None, "out": str(out)}}
            if rep == 0 and s.gguf is None and args.check:
                rec["answers_equal_alone"] = checked[s.name] = check(s, install, work, answers, args)
            records.append(rec)
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"rep {rep} {s.name}{' (disturbed)' if g.disturbed else ''}: hit {rec['hit_rate']:.0%}, turn 1 "
                  f"of users 2..: hit {rec['first_turn_hit_rate']:.0%}, TTFT p50 {rec['first_turn_ttft_p50_ms']:.0f} ms; "
                  f"{rec['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    print(f"records: {out}", file=sys.stderr)
    table(systems, records, checked, work, args)


if __name__ == "__main__":
    main()
