"""Load generator for `python -m turbo task=serve` (or any OpenAI-compatible server on this
machine): N concurrent clients through the official `openai` client, bounded in requests and in
time, greedy, streamed. Every answer is checked against the same request run alone first (one at
a time, before the load): a mismatch is reported loudly and the exit status is 1. It reports the
aggregate generated tokens/s and p50/p99 time to first token and per-output-token latency.

    python -m turbo task=serve &                   # (another terminal)
    python -m scripts.load --concurrency 4 --requests 32 --max-tokens 64 --prompts code
    python -m scripts.load --prompts repetitive --turbo '{"drafter": "ngram", "block": 8}'

--prompts: a workload of conf/workload (prose, code, math, edit), `repetitive` (text that repeats
itself, where the n-gram drafter lands), or a UTF-8 file with one prompt per line. --json writes
the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import openai
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
REPETITIVE = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "one two three four, one two three four, one two three four, one two",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(",
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the",
]


@dataclass
class Result:
    prompt: int
    text: str
    tokens: int
    ttft_s: float
    per_token_s: float | None  # None: one token, no interval


def prompts_of(spec: str) -> list[str]:
    if spec == "repetitive":
        return REPETITIVE
    workload = ROOT / "conf" / "workload" / f"{spec}.yaml"
    if workload.is_file():
        return [str(p) for p in OmegaConf.load(workload).prompts]
    path = Path(spec)
    if not path.is_file():
        sys.exit(f"error: --prompts {spec}: not a workload of conf/workload, `repetitive`, nor a file")
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def one(client: openai.OpenAI, model: str, prompt: str, i: int, args) -> Result:
    """One streamed greedy completion, timed."""
    start = time.perf_counter()
    first = last = None
    text, tokens, chunks = [], 0, 0
    extra = {"ignore_eos": True} if args.ignore_eos else {}
    if args.turbo:
        extra["turbo"] = json.loads(args.turbo)
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}, extra_body=extra):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices:  # a step's tokens (the server sends one per step; its text may be held back)
            last = time.perf_counter()
            first = first or last
            chunks += 1
        if chunk.choices and chunk.choices[0].text:
            text.append(chunk.choices[0].text)
    tokens = tokens or chunks  # (a server that reports no usage in a stream: a chunk a token, as llama.cpp's)
    first, last = first or time.perf_counter(), last or time.perf_counter()
    per = (last - first) / (tokens - 1) if tokens > 1 else None
    return Result(i, "".join(text), tokens, first - start, per)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds for the load (no new request after)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", default="code")
    ap.add_argument("--ignore-eos", action="store_true", help="every answer max-tokens long (vLLM's ignore_eos)")
    ap.add_argument("--turbo", default=None, help='the request\'s turbo object, e.g. \'{"drafter": "ngram"}\'')
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--no-check", action="store_true", help="skip the solo runs (timing repetitions of a checked load)")
    args = ap.parse_args()
    if urlparse(args.base_url).hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"error: --base-url {args.base_url}: this load generator drives 127.0.0.1 only")
    if args.concurrency < 1 or args.requests < 1 or args.max_tokens < 1:
        sys.exit("error: --concurrency, --requests and --max-tokens must be positive")
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=args.time_limit)
    model = args.model or client.models.list().data[0].id
    prompts = prompts_of(args.prompts)
    used = [i % len(prompts) for i in range(args.requests)]

    # each distinct request alone, one after another: the answers the load must give
    t0 = time.perf_counter()
    alone = {} if args.no_check else {i: one(client, model, prompts[i], i, args) for i in sorted(set(used))}
    alone_wall = time.perf_counter() - t0

    results: list[Result] = []
    failures: list[str] = []
    lock, todo = threading.Lock(), list(reversed(used))
    deadline = time.perf_counter() + args.time_limit

    def client_loop() -> None:
        while time.perf_counter() < deadline:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            try:
                r = one(client, model, prompts[i], i, args)
            except openai.APIError as e:
                with lock:
                    failures.append(f"prompt {i}: {type(e).__name__}: {e}")
                continue
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start

    mismatches = [r for r in results if r.prompt in alone and r.text != alone[r.prompt].text]
    for r in mismatches:
        print(f"MISMATCH prompt {r.prompt}: under load {r.text!r}\n         alone      {alone[r.prompt].text!r}",
              file=sys.stderr)
    tokens = sum(r.tokens for r in results)
    ttft = [r.ttft_s for r in results]
    tpot = [r.per_token_s for r in results if r.per_token_s is not None]
    figures = {
        "model": model, "concurrency": args.concurrency, "requests_done": len(results), "refused": len(failures),
        "mismatches": len(mismatches), "seconds": round(wall, 3), "generated_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
        "alone_tokens_per_s": round(sum(r.tokens for r in alone.values()) / alone_wall, 2) if alone else None,
        "ttft_p50_ms": round(1000 * percentile(ttft, 50), 1), "ttft_p99_ms": round(1000 * percentile(ttft, 99), 1),
        "tpot_p50_ms": round(1000 * percentile(tpot, 50), 1), "tpot_p99_ms": round(1000 * percentile(tpot, 99), 1),
    }
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    for f in failures[:10]:
        print(f"refused: {f}", file=sys.stderr)
    if mismatches:
        print(f"ERROR: {len(mismatches)} of {len(results)} answers differ from the same request run alone",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
