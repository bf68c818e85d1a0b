"""A burst of 4x the queue bound at `python -m turbo task=serve`: every request is either served
with the answer it gets alone or refused with 429/503 -- none lost, none wrong -- and the server's
peak RSS (VmHWM) against its memory budget.

    python -m scripts.bench_overload [--shape qwen3.5-0.8b] [--threads 2] [--max-running 4] [--max-waiting 8]
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from scripts.bench_serve import start
from turbo.testing import shapes


def vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b", choices=("tiny", *shapes.SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--max-waiting", type=int, default=8)
    ap.add_argument("--memory-gb", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    install = "install=tiny" if args.shape == "tiny" else f"install.path={shapes.build(args.shape)}"
    proc, url = start([sys.executable, "-m", "turbo", "task=serve", install, f"threads={args.threads}",
                       "backend=cpu", "serve.port=0", f"serve.max_running={args.max_running}",
                       f"serve.max_waiting={args.max_waiting}", f"serve.memory_gb={args.memory_gb}"])
    try:
        client = openai.OpenAI(base_url=f"http://{url}/v1", api_key="none", max_retries=0, timeout=3600)
        model = client.models.list().data[0].id
        prompts = [f"def function_{i}(x):" for i in range(8)]

        def ask(i: int):
            try:
                r = client.completions.create(model=model, prompt=prompts[i % len(prompts)],
                                              max_tokens=args.max_tokens, temperature=0)
                return r.choices[0].text
            except openai.APIStatusError as e:
                return e.status_code

        before = vm_hwm_mb(proc.pid)
        alone = [ask(i) for i in range(len(prompts))]
        burst = 4 * args.max_waiting
        with ThreadPoolExecutor(burst) as pool:
            got = list(pool.map(ask, range(burst)))
        served = sum(isinstance(g, str) for g in got)
        refused = sum(g in (429, 503) for g in got)
        wrong = [i for i, g in enumerate(got) if isinstance(g, str) and g != alone[i % len(prompts)]]
        other = [g for g in got if not isinstance(g, str) and g not in (429, 503)]
        print(f"shape {args.shape}: burst of {burst} (4 x serve.max_waiting {args.max_waiting}, max_running "
              f"{args.max_running}): {served} served, {refused} refused 429/503, {len(wrong)} wrong, "
              f"{len(other)} other; server peak RSS {vm_hwm_mb(proc.pid):.0f} MB (after opening: "
              f"{before:.0f} MB), serve.memory_gb {args.memory_gb:g}")
        if wrong or other or served + refused != burst:
            sys.exit(1)
    finally:
        proc.send_signal(2)
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
