"""Well-behaved clients under hostile ones (issue 48): a server (task=serve, a small VL install
made by turbo.vision.testing, serve.max_body_mb=1, serve.image_dirs holding named pipes) answers
8 clients' greedy chat requests, first undisturbed, then while attackers send bodies over the
limit (declared and chunked), prompts longer than the context could hold, and image URLs naming a
named pipe. Prints each phase's latency p50 / p99 / max, whether every answer is the undisturbed
run's, the attacks' status codes, and the server's peak RSS (VmHWM).

    python scripts/bench_attack.py [--requests 6] [--attackers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_vision_doors import TEMPLATE  # noqa: E402
from turbo.testing.checks import served_address  # noqa: E402
from turbo.vision.testing import make_vl_install  # noqa: E402

CLIENTS = 8
QUESTIONS = ["Write a haiku.", "What is os.path.join?", "Count to five.", "Name a colour.", "Say hello.",
             "Explain a list.", "Why is the sky blue?", "Give me a word."]


def p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6, help="requests per client per phase")
    ap.add_argument("--attackers", type=int, default=4, help="attacker processes")
    ap.add_argument("--attacker-nice", type=int, default=0,
                    help="their niceness (10: the machine's cores go to the server first, as when they are elsewhere)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="turbo-attack-"))
    _, install = make_vl_install(tmp, seed=2)
    (tmp / "vl.jinja").write_text(TEMPLATE)
    (tmp / "images").mkdir()
    for i in range(4):
        os.mkfifo(tmp / "images" / f"pipe{i}.png")
    cmd = [sys.executable, "-m", "turbo", "task=serve", "serve.port=0", "threads=2", "backend=cpu",
           f"install.path={install}", f"serve.chat_template={tmp / 'vl.jinja'}", "serve.max_running=8",
           "serve.max_body_mb=1", f"serve.image_dirs=[{tmp / 'images'}]"]
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = served_address(proc).split()[-1]  # the address line, on stderr
    model = install.name

    def ask(i: int) -> tuple[str, float]:
        body = {"model": model, "messages": [{"role": "user", "content": QUESTIONS[i % CLIENTS]}],
                "max_tokens": 16, "temperature": 0}
        t = time.perf_counter()
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        return r.json()["choices"][0]["message"]["content"], time.perf_counter() - t

    def phase() -> tuple[list[list[str]], list[float]]:
        def client(i: int):
            return [ask(i) for _ in range(args.requests)]
        with ThreadPoolExecutor(CLIENTS) as pool:
            runs = list(pool.map(client, range(CLIENTS)))
        return [[a for a, _ in r] for r in runs], [t for r in runs for _, t in r]

    try:
        phase()  # warm
        calm_answers, calm = phase()
        stop = multiprocessing.Event()
        codes = multiprocessing.Manager().dict()
        procs = [multiprocessing.Process(target=attacker, args=(k, url, model, str(tmp), stop, codes, args.attacker_nice),
                                         daemon=True) for k in range(args.attackers)]
        for a in procs:
            a.start()
        hostile_answers, hostile = phase()
        stop.set()
        for a in procs:
            a.join(60)
        with open(f"/proc/{proc.pid}/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
        for name, xs in (("undisturbed", calm), ("under attack", hostile)):
            print(f"{name:>12}: {len(xs)} requests, p50 {p(xs, .5):.3f} s, p99 {p(xs, .99):.3f} s, "
                  f"max {max(xs):.3f} s")
        print(f"p99 under attack / undisturbed: {p(hostile, .99) / p(calm, .99):.2f}x; answers unchanged: "
              f"{hostile_answers == calm_answers}")
        print("attacks answered: " + ", ".join(f"{k}: {v}" for k, v in sorted(codes.items())))
        print(f"server peak RSS (VmHWM): {hwm:.0f} MiB")
    finally:
        proc.send_signal(2)
        proc.wait(30)
    return 0 if hostile_answers == calm_answers else 1


def make_attacks(url: str, model: str, tmp: Path) -> list:
    big = json.dumps({"model": model, "prompt": "x" * (3 << 20)}).encode()
    return [
        ("large body", lambda: httpx.post(url + "/v1/completions", content=big, timeout=60)),
        ("chunked body", lambda: httpx.post(url + "/v1/completions", timeout=60,
                                            content=(big[j:j + 65536] for j in range(0, len(big), 65536)))),
        ("long prompt", lambda: httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "ab " * 300_000, "max_tokens": 4})),
        ("pipe image", lambda: httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"file://{tmp}/images/pipe0.png"}},
                {"type": "text", "text": "What is it?"}]}]})),
    ]


def attacker(k: int, url: str, model: str, tmp: str, stop, codes, niceness: int) -> None:
    """One attacker process (niced by --attacker-nice: the attackers' own CPU is not the server's)."""
    os.nice(niceness)
    attacks = make_attacks(url, model, Path(tmp))
    while not stop.is_set():
        name, send = attacks[k % len(attacks)]
        key = f"{name} {send().status_code}"
        codes[key] = codes.get(key, 0) + 1


if __name__ == "__main__":
    sys.exit(main())
