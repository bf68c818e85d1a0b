"""Real-scale CPU benchmark: a random checkpoint of a published shape through turbo,
transformers (bf16) and, where `llama_cpp` imports, llama.cpp (bf16 GGUF), interleaved.

    flock /work/locks/bench.lock python scripts/bench_scale.py qwen3.5-0.8b --prompts 512 --reps 3
    flock /work/locks/bench.lock python scripts/bench_scale.py qwen3.5-0.8b --prompts 4096 --reps 1 --out runs.jsonl
    flock /work/locks/bench.lock python scripts/bench_scale.py qwen3.5-0.8b --kv-cache float32 bfloat16 \
        --only "turbo kv=float32" "turbo kv=bfloat16" --reps 1

The checkpoint and its install come from scripts/shapes.py (built once, cached); the GGUF
is converted beside them with the converter llama-cpp-python vendors (docs/llamacpp.md).
Every repetition runs each system in a fresh process, one after another (A, B, C, A, B,
C, ...), so load time and peak memory are that process's own. A worker reports: load time
and peak RSS while loading; per prompt length n: prefill tok/s and the peak RSS during it,
then plain greedy decode tok/s at context n (--new steps) with its tokens and each step's
top-2 logit gap. Peak RSS is VmHWM, reset (/proc/self/clear_refs 5) as each phase starts.
The machine's read bandwidth (a GEMV over 1 GB, 1 and all threads) is measured in the run.

Records are appended to --out (JSON lines), and the table is printed over every record
there: medians with [min, max], so runs split over several invocations (each under the
bench lock, each short) still make one table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import shapes  # noqa: E402

VOCAB_IDS = 4096  # prompt ids below the shapes' tokenizer size (the GGUF's vocab is the tokenizer's)
KV_TAG = " kv="  # a turbo system's name carries its kv_cache after this ("turbo kv=bfloat16")
CONVERTER_ENV = "LLAMA_CONVERT_DIR"  # vendor/llama.cpp of llama-cpp-python's sdist (docs/llamacpp.md)


# ---- measurements inside a worker -----------------------------------------------------------


def status(key: str) -> int:
    """A /proc/self/status field in bytes."""
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith(key)).split()[1])


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def prompt_ids(n: int) -> list[int]:
    import torch

    return torch.randint(3, VOCAB_IDS, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def top2_gap(logits) -> tuple[int, float]:
    import torch

    top = torch.as_tensor(logits).float().topk(2)
    return int(top.indices[0]), float(top.values[0] - top.values[1])


class Turbo:
    def __init__(self, shape: str, threads: int, kv_cache: str | None):
        import torch

        import turbo

        install = shapes.build(shape)
        # (kv_cache only when asked: a --baseline checkout may predate the option)
        self.rt = turbo.open(install, threads=threads, **({"kv_cache": kv_cache} if kv_cache else {}))
        self.trunk, self.torch = self.rt.trunk, torch

    def prefill(self, ids: list[int], new: int):
        self.st = self.trunk.new_state(len(ids) + new + 1)
        return self.trunk.prefill(self.st, ids).logits[-1]

    def decode(self, token: int):
        return self.trunk.step(self.st, [token], (), None).logits[-1]

    def bytes_per_token(self, context: int) -> int:
        """What one decode step reads: every matrix once (the lm_head too), the cached K/V of
        `context` positions, and each GDN state (read and written)."""
        mats = sum(m.data.nbytes for m in self.trunk.matrices())
        kv = sum(2 * k[:, :context].nbytes for k, _ in self.st.kv.values())
        gdn = sum(2 * s.nbytes for s, _ in self.st.gdn.values())
        return mats + kv + gdn

    def release(self) -> None:
        del self.st


class Transformers:
    def __init__(self, shape: str, threads: int):
        import torch
        from transformers import Qwen3_5ForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = Qwen3_5ForCausalLM.from_pretrained(shapes.checkpoint(shape), dtype=torch.bfloat16).eval()

    def prefill(self, ids: list[int], new: int):
        with self.torch.no_grad():
            out = self.model(input_ids=self.torch.tensor([ids]), use_cache=True, logits_to_keep=1)  # as generate
        self.past = out.past_key_values
        return out.logits[0, -1]

    def decode(self, token: int):
        with self.torch.no_grad():
            out = self.model(input_ids=self.torch.tensor([[token]]), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return out.logits[0, -1]

    def release(self) -> None:
        del self.past


def gguf_path(shape: str) -> Path:
    return shapes.DEFAULT_CACHE / shape / "model-bf16.gguf"


class LlamaCpp:
    def __init__(self, shape: str, threads: int, n_ctx: int):
        import numpy as np
        from llama_cpp import Llama

        self.np = np
        self.llm = Llama(model_path=str(gguf_path(shape)), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                         n_threads=threads, n_threads_batch=threads, verbose=False)

    def _logits(self):
        return self.np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),)).copy()

    def prefill(self, ids: list[int], new: int):
        self.llm.reset()
        self.llm.eval(ids)
        return self._logits()

    def decode(self, token: int):
        self.llm.eval([token])
        return self._logits()

    def release(self) -> None:
        self.llm.reset()


def worker(system: str, shape: str, threads: int, prompts: list[int], new: int) -> dict:
    reset_peak()
    t0 = time.perf_counter()
    if system == "llama.cpp":
        sut = LlamaCpp(shape, threads, max(prompts) + new + 8)
    else:
        kv_cache = system.partition(KV_TAG)[2] or None
        sut = Turbo(shape, threads, kv_cache) if system.startswith("turbo") else Transformers(shape, threads)
    rec = {"system": system, "load_s": time.perf_counter() - t0, "load_peak": status("VmHWM")}
    for n in prompts:
        ids = prompt_ids(n)
        reset_peak()
        t0 = time.perf_counter()
        logits = sut.prefill(ids, new)
        prefill_s = time.perf_counter() - t0
        prefill_peak = status("VmHWM")
        tokens, gaps = [], []
        t0 = time.perf_counter()
        for _ in range(new):
            token, gap = top2_gap(logits)
            tokens.append(token)
            gaps.append(gap)
            logits = sut.decode(token)
        decode_s = time.perf_counter() - t0
        rec[str(n)] = {"prefill_tps": n / prefill_s, "prefill_peak": prefill_peak, "decode_tps": new / decode_s,
                       "decode_peak": status("VmHWM"), "tokens": tokens, "gaps": gaps}
        if isinstance(sut, Turbo):
            rec[str(n)]["bytes_per_token"] = sut.bytes_per_token(n + new // 2)
        sut.release()
    return rec


def bandwidth(threads: int) -> float:
    """GB/s of a matrix-vector product over 1 GB of fp32 (torch's BLAS GEMV, which streams
    the matrix once: a plain sum is slower than memory here), the median of 5 after a warm-up."""
    import torch

    torch.set_num_threads(threads)
    w, x = torch.ones(1 << 18, 1024), torch.ones(1024)
    torch.mv(w, x)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mv(w, x)
        times.append(time.perf_counter() - t0)
    return w.nbytes / statistics.median(times) / 1e9


# ---- the driver -----------------------------------------------------------------------------


def convert_gguf(shape: str) -> Path | None:
    """The checkpoint as a bf16 GGUF (converted once), or None without the converter. The
    shapes' tokenizer is a small BPE the converter does not know by hash: the prompts are
    ids, so its pre-tokenizer is named as Qwen's."""
    out = gguf_path(shape)
    conv = os.environ.get(CONVERTER_ENV)
    if out.is_file() or not conv:
        return out if out.is_file() else None
    code = (f"import sys, runpy; sys.path[:0] = [{conv!r}, {conv + '/gguf-py'!r}]\n"
            "import conversion.base as b\n"
            "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
            f"sys.argv = ['convert_hf_to_gguf.py', {str(shapes.checkpoint(shape))!r}, '--no-mtp', "
            f"'--outtype', 'bf16', '--outfile', {str(out)!r}]\n"
            f"runpy.run_path({conv + '/convert_hf_to_gguf.py'!r}, run_name='__main__')\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    return out


def systems(shape: str, baseline: Path | None, kv_caches: list[str]) -> list[tuple[str, dict]]:
    """(name, environment) of every system this machine can run: turbo once per kv_cache asked."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = [(f"turbo{KV_TAG}{kv}", env) for kv in kv_caches] or [("turbo", env)]
    if baseline is not None:
        out.append((f"turbo@{baseline.name}", dict(os.environ, PYTHONPATH=str(baseline))))
    out.append(("transformers", env))
    try:
        import llama_cpp  # noqa: F401

        if convert_gguf(shape) is not None:
            out.append(("llama.cpp", env))
        else:
            print(f"llama.cpp: no GGUF and no converter (set {CONVERTER_ENV}; docs/llamacpp.md)", file=sys.stderr)
    except ImportError:
        print("llama.cpp: llama_cpp does not import (pip install llama-cpp-python)", file=sys.stderr)
    return out


def med(values: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    v = [x / scale for x in values]
    return f"{fmt.format(statistics.median(v))} [{fmt.format(min(v))}, {fmt.format(max(v))}]"


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def report(records: list[dict], bw: list[dict]) -> str:
    gb = 1e9
    names = list(dict.fromkeys(r["system"] for r in records))
    by = {s: [r for r in records if r["system"] == s] for s in names}
    lines = ["| | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]

    def row(label: str, get, **kw) -> None:
        cells = []
        for s in names:
            vals = [v for v in (get(r) for r in by[s]) if v is not None]
            cells.append(med(vals, **kw) if vals else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("load s", lambda r: r["load_s"], fmt="{:.2f}")
    row("peak RSS while loading, GB", lambda r: r["load_peak"], scale=gb, fmt="{:.2f}")
    lengths = sorted({int(k) for r in records for k in r if k.isdigit()})
    for n in lengths:
        k = str(n)
        row(f"prefill {n} tok/s", lambda r: r[k]["prefill_tps"] if k in r else None)
        row(f"peak RSS, prefill {n}, GB", lambda r: r[k]["prefill_peak"] if k in r else None, scale=gb, fmt="{:.2f}")
        row(f"decode tok/s at {n}", lambda r: r[k]["decode_tps"] if k in r else None)
        row(f"GB read per decode token at {n}",
            lambda r: r[k].get("bytes_per_token") if k in r else None, scale=gb, fmt="{:.3f}")
        row(f"implied GB/s at {n}",
            lambda r: r[k]["bytes_per_token"] * r[k]["decode_tps"] if k in r and "bytes_per_token" in r[k] else None,
            scale=gb)
    lines.append("")
    for b in bw:
        lines.append(f"read bandwidth (GEMV over 1 GB): {b['one']:.1f} GB/s on 1 thread, {b['all']:.1f} GB/s on "
                     f"{b['threads']}")
    ref = by[names[0]][-1]
    for n in lengths:
        for s in names[1:]:
            other = by[s][-1]
            if str(n) not in other or str(n) not in ref:
                continue
            a, b = ref[str(n)], other[str(n)]
            i = first_divergence(a["tokens"], b["tokens"])
            where = ("identical" if i is None else
                     f"first divergence at step {i} (top-2 gap there: {names[0]} {a['gaps'][i]:.3f}, "
                     f"{s} {b['gaps'][i]:.3f})")
            lines.append(f"greedy tokens after the {n}-token prompt, {names[0]} vs {s} ({len(a['tokens'])} steps): "
                         f"{where}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(shapes.SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--new", type=int, default=32, help="decode steps timed after each prompt")
    ap.add_argument("--out", type=Path, default=Path("bench_scale.jsonl"))
    ap.add_argument("--baseline", type=Path, help="another turbo checkout, run as one more system")
    ap.add_argument("--only", nargs="+", help="run only these systems")
    ap.add_argument("--kv-cache", nargs="+", default=[], choices=("auto", "float32", "bfloat16"),
                    help="turbo's K/V cache (OpenOptions.kv_cache), each value its own system 'turbo kv=VALUE'")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a system's worker may take")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.shape, args.threads, args.prompts, args.new)))
        return
    shapes.build(args.shape)
    chosen = [s for s in systems(args.shape, args.baseline, args.kv_cache) if not args.only or s[0] in args.only]
    print(f"load: {os.getloadavg()}", file=sys.stderr)
    for rep in range(args.reps):
        for name, env in chosen:
            cmd = [sys.executable, __file__, args.shape, "--worker", name, "--threads", str(args.threads),
                   "--new", str(args.new), "--prompts", *map(str, args.prompts)]
            try:
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"rep {rep} {name}: over {args.timeout} s, left out", file=sys.stderr)
                continue
            if done.returncode != 0:
                raise SystemExit(f"{name}: {done.stderr.strip()[-2000:]}")
            rec = json.loads(done.stdout.strip().splitlines()[-1])
            rec["rep"], rec["threads"] = rep, args.threads
            with args.out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"rep {rep} {name}: load {rec['load_s']:.2f} s, "
                  + ", ".join(f"{n}: prefill {rec[str(n)]['prefill_tps']:.1f}, decode {rec[str(n)]['decode_tps']:.1f}"
                              for n in args.prompts), file=sys.stderr)
    with args.out.open("a") as f:
        f.write(json.dumps({"bandwidth": True, "one": bandwidth(1), "all": bandwidth(args.threads),
                            "threads": args.threads}) + "\n")
    records = [json.loads(line) for line in args.out.read_text().splitlines()]
    print(report([r for r in records if "system" in r and r["threads"] == args.threads],
                 [r for r in records if "bandwidth" in r]))


if __name__ == "__main__":
    main()
