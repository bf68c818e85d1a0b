"""Well-behaved clients under hostile ones : a server (task=serve, a small VL install
made by turbo.testing.vision, serve.max_body_mb=1, serve.image_dirs holding named pipes) answers
8 clients' greedy chat requests, first undisturbed, then while attackers send bodies over the
limit (declared and chunked), prompts longer than the context could hold, and image URLs naming a
named pipe. Each client streams its answers (16 tokens) over one kept-alive connection; each
attacker process sends one attack's request, built once, over a fresh raw socket, back to back.
Prints each phase's latency and time to first token (p50 / p99), whether every answer is the
undisturbed run's, the attacks' status codes and rate, the server's CPU by thread (the event
loop's apart), and its peak RSS (VmHWM).

    python -m scripts.bench_attack [--requests 6] [--attackers 4] [--attacker-nice 0]
        [--serve serve.http_nice=5] [--profile PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.test_vision_doors import TEMPLATE
from turbo.testing.checks import served_address
from turbo.testing.vision import make_vl_install

ROOT = Path(__file__).resolve().parents[1]

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
    ap.add_argument("--threads", type=int, default=2, help="the server's threads (its engine's)")
    ap.add_argument("--serve", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more overrides for the server (e.g. serve.http_nice=0 to compare)")
    ap.add_argument("--cost", type=int, default=20, metavar="N",
                    help="first send each attack N times, one at a time, and report the server's CPU per attack "
                         "(0: skip)")
    ap.add_argument("--profile", metavar="PATH", help="run the server under cProfile (its event loop, the main "
                    "thread), the stats written to PATH when it stops")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="turbo-attack-"))
    _, install = make_vl_install(tmp, seed=2)
    (tmp / "vl.jinja").write_text(TEMPLATE)
    (tmp / "images").mkdir()
    for i in range(4):
        os.mkfifo(tmp / "images" / f"pipe{i}.png")
    profile = ["-m", "cProfile", "-o", str(Path(args.profile).absolute())] if args.profile else []
    cmd = [sys.executable, *profile, "-m", "turbo", "task=serve", "serve.port=0", f"threads={args.threads}", "backend=cpu",
           f"install.path={install}", f"serve.chat_template={tmp / 'vl.jinja'}", "serve.max_running=8",
           "serve.max_body_mb=1", f"serve.image_dirs=[{tmp / 'images'}]", *args.serve]
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = served_address(proc).split()[-1]  # the address line, on stderr
    model = install.name

    def ask(http: httpx.Client, i: int) -> tuple[str, float, float]:
        """One streamed greedy chat request: its text, latency (to [DONE]) and time to first token."""
        body = {"model": model, "messages": [{"role": "user", "content": QUESTIONS[i % CLIENTS]}],
                "max_tokens": 16, "temperature": 0, "stream": True}
        t, first, text = time.perf_counter(), None, []
        with http.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[6:])["choices"]
                delta = choices[0]["delta"] if choices else {}
                piece = (delta.get("reasoning_content") or "") + (delta.get("content") or "")
                if piece and first is None:
                    first = time.perf_counter() - t
                text.append(piece)
        total = time.perf_counter() - t
        return "".join(text), total, first if first is not None else total

    def phase() -> tuple[list[list[str]], list[float], list[float]]:
        def client(i: int):  # (one connection each, kept alive: a well-behaved client)
            with httpx.Client() as http:
                return [ask(http, i) for _ in range(args.requests)]
        with ThreadPoolExecutor(CLIENTS) as pool:
            runs = list(pool.map(client, range(CLIENTS)))
        return [[a for a, _, _ in r] for r in runs], [t for r in runs for _, t, _ in r], \
            [f for r in runs for _, _, f in r]

    try:
        phase()  # warm
        if args.cost:
            print(attack_costs(proc.pid, url, model, tmp, args.cost))
        cpu0, t0 = server_cpu(proc.pid), time.perf_counter()
        calm_answers, calm, calm_ttft = phase()
        calm_cpu = cpu_line(proc.pid, cpu0, server_cpu(proc.pid), time.perf_counter() - t0)
        stop, out = multiprocessing.Event(), multiprocessing.Queue()
        procs = [multiprocessing.Process(target=attacker, args=(k, url, model, str(tmp), stop, out, args.attacker_nice),
                                         daemon=True) for k in range(args.attackers)]
        for a in procs:
            a.start()
        cpu0, start = server_cpu(proc.pid), time.perf_counter()
        hostile_answers, hostile, hostile_ttft = phase()
        seconds = time.perf_counter() - start
        hostile_cpu = cpu_line(proc.pid, cpu0, server_cpu(proc.pid), seconds)
        stop.set()
        codes: Counter = Counter()
        for _ in procs:
            codes.update(out.get(timeout=120))
        for a in procs:
            a.join(60)
        hwm = {pid: peak_rss(pid) for pid in (proc.pid, front_pid(proc.pid)) if pid is not None}
        for name, xs, ts in (("undisturbed", calm, calm_ttft), ("under attack", hostile, hostile_ttft)):
            print(f"{name:>12}: {len(xs)} requests, p50 {p(xs, .5):.3f} s, p99 {p(xs, .99):.3f} s, "
                  f"max {max(xs):.3f} s; time to first token p50 {p(ts, .5):.3f} s, p99 {p(ts, .99):.3f} s")
        print(f" undisturbed: {calm_cpu}\nunder attack: {hostile_cpu}")
        print(f"p99 under attack / undisturbed: {p(hostile, .99) / p(calm, .99):.2f}x (time to first token "
              f"{p(hostile_ttft, .99) / p(calm_ttft, .99):.2f}x); answers unchanged: "
              f"{hostile_answers == calm_answers}")
        print(f"attacks answered: {sum(codes.values())} ({sum(codes.values()) / seconds:.1f} a second): "
              + ", ".join(f"{k}: {v}" for k, v in sorted(codes.items())))
        print("server peak RSS (VmHWM): " + ", ".join(f"{'engine' if pid == proc.pid else 'front'} {mib:.0f} MiB"
                                                      for pid, mib in hwm.items()))
    finally:
        proc.send_signal(2)
        proc.wait(30)
    return 0 if hostile_answers == calm_answers else 1


def http_request(url: str, path: str, body: bytes, chunked: bool = False) -> bytes:
    """One whole POST as bytes (built once: the attacker spends its CPU sending, not building)."""
    host = url.split("://", 1)[1]
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nConnection: close\r\n"
    if chunked:
        payload = b"".join(b"%x\r\n" % len(body[j:j + 65536]) + body[j:j + 65536] + b"\r\n"
                           for j in range(0, len(body), 65536)) + b"0\r\n\r\n"
        return (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + payload
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def make_attacks(url: str, model: str, tmp: Path) -> list[tuple[str, bytes]]:
    big = json.dumps({"model": model, "prompt": "x" * (3 << 20)}).encode()
    return [
        ("large body", http_request(url, "/v1/completions", big)),
        ("chunked body", http_request(url, "/v1/completions", big, chunked=True)),
        ("long prompt", http_request(url, "/v1/completions", json.dumps(
            {"model": model, "prompt": "ab " * 300_000, "max_tokens": 4}).encode())),
        ("pipe image", http_request(url, "/v1/chat/completions", json.dumps(
            {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"file://{tmp}/images/pipe0.png"}},
                {"type": "text", "text": "What is it?"}]}]}).encode())),
    ]


def send(address: tuple[str, int], raw: bytes) -> str:
    """Send one prebuilt request over a fresh connection; its status code, or `reset` when the
    server's answer could not be read (the server may close as soon as it has answered)."""
    got = b""
    with socket.create_connection(address, timeout=60) as s:
        try:
            s.sendall(raw)
        except OSError:  # (closed by the server once it refused: its answer may be in our buffer)
            pass
        try:
            while b"\r\n" not in got:
                more = s.recv(4096)
                if not more:
                    break
                got += more
        except OSError:
            pass
    return got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/1.1 ") else "reset"


def thread_cpu(pid: int, system: bool = True) -> dict[int, float]:
    """CPU seconds of each of the process's threads, by thread id: user + system (system False:
    user alone)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:  # (a thread that ended)
            continue
        out[int(tid)] = (int(stat[11]) + (int(stat[12]) if system else 0)) / tick
    return out


def front_pid(pid: int) -> int | None:
    """The server's front process (serve.front=process: turbo/serve/front.py), None inline."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        return None
    return kids[0] if kids else None


def server_cpu(pid: int, system: bool = True) -> dict[int, float]:
    """thread_cpu of the engine's process and of its front process, if any."""
    front = front_pid(pid)
    return {**thread_cpu(pid, system), **(thread_cpu(front, system) if front is not None else {})}


def peak_rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def cpu_line(pid: int, before: dict[int, float], after: dict[int, float], seconds: float) -> str:
    used = {t: after[t] - before.get(t, 0.0) for t in after}
    front = front_pid(pid)
    front_tids = set(os.listdir(f"/proc/{front}/task")) if front is not None else set()
    front_s = sum(v for t, v in used.items() if str(t) in front_tids)
    loop = used.pop(pid, 0.0)
    rest = sorted((v for t, v in used.items() if str(t) not in front_tids), reverse=True)
    return (f"CPU {sum(rest) + loop + front_s:.1f} s in {seconds:.1f} s: front process {front_s:.1f} s; engine's "
            f"process: event loop (main thread) {loop:.1f} s, other threads {sum(rest):.1f} s (busiest "
            f"{', '.join(f'{x:.1f}' for x in rest[:3])})")


def attack_costs(pid: int, url: str, model: str, tmp: Path, n: int) -> str:
    """The server's CPU per attack of each kind, sent n times one after another (no client, no
    other attacker): the event loop's thread and the others (the engine's, asyncio's workers)."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    out = []
    for name, raw in make_attacks(url, model, tmp):
        send((host, int(port)), raw)
        front = front_pid(pid)
        before = server_cpu(pid)
        codes = Counter(send((host, int(port)), raw) for _ in range(n))
        used = {t: v - before.get(t, 0.0) for t, v in server_cpu(pid).items()}
        front_s = sum(used.pop(int(t), 0.0) for t in (os.listdir(f"/proc/{front}/task") if front else ()))
        loop = used.pop(pid, 0.0)
        out.append(f"{name} ({'/'.join(codes)}): front {1000 * front_s / n:.1f} ms, engine's loop "
                   f"{1000 * loop / n:.1f} ms + its others {1000 * sum(used.values()) / n:.1f} ms")
    return "server CPU per attack: " + "; ".join(out)


def attacker(k: int, url: str, model: str, tmp: str, stop, out, niceness: int) -> None:
    """One attacker process (niced by --attacker-nice: the attackers' own CPU is not the server's):
    one attack's prebuilt bytes over raw sockets, back to back, its answers counted."""
    os.nice(niceness)
    name, raw = make_attacks(url, model, Path(tmp))[k % 4]
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    codes: Counter = Counter()
    while not stop.is_set():
        codes[f"{name} {send((host, int(port)), raw)}"] += 1
    out.put(dict(codes))


if __name__ == "__main__":
    sys.exit(main())
