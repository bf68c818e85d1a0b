"""Time to first token of a chat session's last turn, which prefills only what the conversation
added, against a fresh generation over the same rendered conversation; interleaved, on a
published shape (random weights) or tiny.

    python -m scripts.bench_session [--shape qwen3.5-0.8b] [--turns 5] [--new 32] [--reps 3] [--threads 2]
    python -m scripts.bench_session --server   # the server's prefix cache instead of a session

Each repetition plays a new session of --turns turns, then times its last turn's TTFT and a
fresh `generate` over that turn's prompt, in alternating order (the tokens must agree). With
--server every turn is an independent request resending the whole conversation to the serving
engine (turbo/serve/scheduler.py), and the last turn's TTFT with the prefix cache is timed against
a cold engine's. Prints medians (min..max). A benchmark, not a test: time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch

import turbo
from scripts import benchlib
from turbo.chat.template import ChatTemplate, encode
from turbo.sequence.options import GenerationOptions
from turbo.serve.scheduler import Request, Scheduler
from turbo.testing import shapes

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
USER = ["Write a function that returns the n-th Fibonacci number, and explain how it works step by step.",
        "Now write the same function in C, with a loop instead of recursion, and say what changes.",
        "Why is the recursive version slow for large n? Give the number of calls it makes for n = 30.",
        "Write a class Stack with push, pop and peek, and a short test that uses each of them once.",
        "Summarise everything we discussed so far in five short bullet points for a newcomer."]


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}..{max(xs):.1f})"


def served(sched: Scheduler, ids: list[int], opts: GenerationOptions) -> tuple[list[int], float, int]:
    """(tokens, TTFT ms, cached prompt tokens) of one request run to its end on `sched`."""
    deltas = []
    sched.submit(Request(ids, opts), deltas.append)
    while not (deltas and deltas[-1].finish):
        sched.step()
    return [t for d in deltas for t in d.tokens], deltas[-1].stats.ttft_s * 1e3, deltas[-1].cached_tokens


def server_turns(rt, args) -> None:
    """The last turn's TTFT through the prefix cache (the earlier turns sent to the same engine)
    against a cold engine's, interleaved."""
    template, opts = ChatTemplate(CHATML, "chatml"), GenerationOptions(max_new_tokens=args.new, policy="off")
    warm, cold, cached, prompt_tokens = [], [], 0, 0
    guard, seen = benchlib.Guard.from_env(args.threads), []
    for rep in range(args.reps):
        sched = Scheduler(rt)
        history = [{"role": "system", "content": "You are a helpful assistant."}]
        for i in range(args.turns):
            history.append({"role": "user", "content": USER[i % len(USER)]})
            ids = encode(rt.tokenizer, template.render(history, add_generation_prompt=True))
            if i < args.turns - 1:
                tokens = served(sched, ids, opts)[0]
                history.append({"role": "assistant", "content": rt.decode(tokens)})
        with guard.rep(f"rep {rep}") as g:  # the timed pair
            if rep % 2 == 0:
                (a, ta, cached), (b, tb, _) = served(sched, ids, opts), served(Scheduler(rt), ids, opts)
            else:
                (b, tb, _), (a, ta, cached) = served(Scheduler(rt), ids, opts), served(sched, ids, opts)
        seen.append({"guard": dataclasses.asdict(g)})
        if a != b:
            sys.exit("the cached turn and the cold one disagree")
        if not g.disturbed:  # a disturbed pair is dropped (benchlib.Guard)
            warm.append(ta)
            cold.append(tb)
        prompt_tokens = len(ids)
    print(f"shape {args.shape}, {args.threads} thread(s), turn {args.turns} resent whole: {prompt_tokens} prompt "
          f"tokens, {cached} from the prefix cache; medians of the undisturbed of {args.reps} interleaved runs "
          f"(min..max)")
    print(benchlib.guard_summary(seen))
    if not warm:
        sys.exit("every repetition was disturbed: rerun on a quiet machine")
    print("| TTFT ms, prefix cache | TTFT ms, cold engine | cold / cached |")
    print("| ---: | ---: | ---: |")
    ratio = [c / w for c, w in zip(cold, warm)]
    print(f"| {med(warm)} | {med(cold)} | {statistics.median(ratio):.2f}x ({min(ratio):.2f}..{max(ratio):.2f}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b", choices=("tiny", *shapes.SHAPES))
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--new", type=int, default=32, help="tokens each answer generates")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server", action="store_true", help="the serving engine's prefix cache, not a session")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rt = turbo.open("tiny" if args.shape == "tiny" else str(shapes.build(args.shape)), backend="cpu")
    if args.server:
        return server_turns(rt, args)
    opts = dict(max_new_tokens=args.new, policy="off")
    kept, fresh, prompt_tokens, prefilled = [], [], 0, 0
    guard, seen = benchlib.Guard.from_env(args.threads), []
    for rep in range(args.reps):
        s = rt.session(system="You are a helpful assistant.", template=CHATML)
        for i in range(args.turns - 1):
            for _ in s.send(USER[i % len(USER)], **opts):
                pass
        s.history.append({"role": "user", "content": USER[(args.turns - 1) % len(USER)]})
        ids = encode(rt.tokenizer, s.render())
        s.history.pop()

        def session_turn() -> list[int]:
            events = list(s.send(USER[(args.turns - 1) % len(USER)], **opts))
            kept.append(events[0].stats.ttft_s * 1e3)
            return [t for e in events for t in e.tokens]

        def fresh_turn() -> list[int]:
            r = rt.generate(ids, stop_token_ids=s.stop_ids, **opts)
            fresh.append(r.stats.ttft_s * 1e3)
            return r.tokens

        with guard.rep(f"rep {rep}") as g:  # the timed pair
            if rep % 2 == 0:
                mine, theirs = session_turn(), fresh_turn()
            else:
                theirs, mine = fresh_turn(), session_turn()
        seen.append({"guard": dataclasses.asdict(g)})
        if mine != theirs:
            sys.exit("the session's turn and the fresh generation disagree")
        if g.disturbed:  # the pair is dropped (benchlib.Guard)
            kept.pop(), fresh.pop()
        prompt_tokens, prefilled = len(ids), s.last_turn.prefilled_tokens
    print(f"shape {args.shape}, {args.threads} thread(s), turn {args.turns} of a session: {prompt_tokens} prompt "
          f"tokens, {prefilled} prefilled; medians of the undisturbed of {args.reps} interleaved runs (min..max)")
    print(benchlib.guard_summary(seen))
    if not kept:
        sys.exit("every repetition was disturbed: rerun on a quiet machine")
    print("| TTFT ms, session (kept state) | TTFT ms, fresh prefill | fresh / session |")
    print("| ---: | ---: | ---: |")
    ratio = [f / k for f, k in zip(fresh, kept)]
    print(f"| {med(kept)} | {med(fresh)} | {statistics.median(ratio):.2f}x ({min(ratio):.2f}..{max(ratio):.2f}) |")


if __name__ == "__main__":
    main()
