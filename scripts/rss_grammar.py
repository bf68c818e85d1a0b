"""The engine's resident set over many varied constrained requests (docs/hardening.md): is it bounded?

    python -m scripts.rss_grammar [--install tiny] [--requests 1000] [--every 100]
    python -m scripts.rss_grammar --url http://127.0.0.1:8000 --pid ENGINE_PID   # a served engine

Request i is one of: a JSON schema of its own (property names, nesting and types drawn from i), a
Lark grammar of its own, a regex of its own, json_object; every fifth names stop_token_ids of its
own too (each set of stop ids is a vocabulary llguidance builds). In-process, each is a greedy
`rt.generate` of a few tokens; with --url, a /v1/completions request to a server, whose engine
process --pid names. Prints VmRSS every --every requests, and the runtime's grammar caches' sizes.
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def schema(rng: random.Random, i: int, depth: int = 0) -> dict:
    """An object schema of a few properties named after `i`, some nested."""
    props = {}
    for k in range(rng.randint(1, 5)):
        kind = rng.choice(["string", "integer", "boolean", "number", "object", "array", "enum"])
        if kind == "object" and depth < 3:
            props[f"p{i}_{k}"] = schema(rng, i, depth + 1)
        elif kind == "array":
            props[f"p{i}_{k}"] = {"type": "array", "items": {"type": "integer"}, "maxItems": rng.randint(1, 4)}
        elif kind == "enum":
            props[f"p{i}_{k}"] = {"enum": [f"v{i}_{j}" for j in range(rng.randint(1, 6))]}
        else:
            props[f"p{i}_{k}"] = {"type": "string" if kind == "object" else kind}
    return {"type": "object", "properties": props, "required": list(props)[:rng.randint(0, len(props))]}


def lark(rng: random.Random, i: int) -> str:
    rules = [f'r{k}: "w{i}_{k}" | r{k + 1}' for k in range(rng.randint(1, 20))]
    return "start: r0\n" + "\n".join(rules) + f'\nr{len(rules)}: "end{i}"\n'


def request(rng: random.Random, i: int, vocab: int) -> dict:
    kind = i % 4
    fmt = [{"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema(rng, i)}},
           {"type": "grammar", "grammar": lark(rng, i)},
           {"type": "regex", "regex": f"(x{i}|y[0-9]{{1,{1 + i % 7}}})+z"},
           {"type": "json_object"}][kind]
    body = {"response_format": fmt}
    if i % 5 == 0:
        body["stop_token_ids"] = sorted(rng.sample(range(1, vocab), 2))
    return body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", default="tiny")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--url", default=None, help="a served engine's address (its front or inline server)")
    parser.add_argument("--pid", type=int, default=None, help="with --url: the engine process whose RSS is read")
    args = parser.parse_args(argv)
    rng = random.Random(57)
    if args.url is None:
        import turbo

        rt = turbo.open(args.install, backend="cpu", threads=1)
        vocab, pid = rt.install.arch.vocab, "self"

        def send(body: dict) -> None:
            rt.generate("The answer as JSON:", max_new_tokens=args.tokens, policy="off", **body)
    else:
        import httpx

        client, vocab, pid = httpx.Client(base_url=args.url, timeout=120), 4096, args.pid  # (ids under any vocab's)
        model = client.get("/v1/models").json()["data"][0]["id"]

        def send(body: dict) -> None:
            r = client.post("/v1/completions", json={"model": model, "prompt": "The answer as JSON:",
                                                     "max_tokens": args.tokens, "temperature": 0, **body})
            assert r.status_code in (200, 400), r.text

    print(f"{'requests':>8} {'VmRSS MiB':>10} {'s':>6}" + ("" if args.url else f" {'compiled':>8} {'vocabs':>6}"))
    start = time.perf_counter()
    for i in range(args.requests + 1):
        if i % args.every == 0:
            caches = "" if args.url else f" {len(rt.grammars.compiled):>8} {len(rt.grammars.tokenizers):>6}"
            print(f"{i:>8} {rss_mib(pid):>10.1f} {time.perf_counter() - start:>6.1f}{caches}", flush=True)
        if i < args.requests:
            send(request(rng, i, vocab))
    return 0


if __name__ == "__main__":
    sys.exit(main())
