"""4-bit decode against llama.cpp's Q4_0 on the same random checkpoint (a benchmark, not a test).

    python scripts/bench_q4.py [--shape qwen3.5-0.8b] [--threads 2] [--reps 3] [--new 64]

turbo runs the `--quant int4` install (scripts/shapes.py), llama.cpp the bf16 GGUF that
scripts/bench_scale.py converts, quantized here once to Q4_0 with llama.cpp's own
llama_model_quantize (docs/llamacpp.md). Both decode `--new` greedy tokens after the same
32-token prompt; each repetition runs the two in fresh processes, one after the other, and the
medians and spreads are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402

PROMPT = list(range(100, 132))


def q4_gguf(shape: str) -> Path:
    import llama_cpp

    bf16 = shapes.DEFAULT_CACHE / shape / "model-bf16.gguf"
    out = bf16.with_name("model-q4_0.gguf")
    if not bf16.is_file():
        raise SystemExit(f"{bf16}: missing (run scripts/bench_scale.py {shape} once: it converts it)")
    if not out.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        tmp = out.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(bf16).encode(), str(tmp).encode(), params) != 0:
            raise SystemExit("llama_model_quantize failed")
        tmp.rename(out)
    return out


def worker(system: str, shape: str, threads: int, new: int) -> dict:
    """One system's decode in this process: tokens/s over `new` steps after the prompt's prefill."""
    if system == "turbo":
        import turbo

        rt = turbo.open(shapes.build(shape, quant="int4"), threads=threads)
        res = rt.generate(PROMPT, max_new_tokens=new, policy="off", stop_at_eos=False)
        return {"decode_tok_s": res.stats.decode_tokens_per_s, "tokens": res.tokens}
    from llama_cpp import Llama

    llm = Llama(model_path=str(q4_gguf(shape)), n_ctx=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    import numpy as np

    llm.eval(PROMPT)
    out, t = [], time.perf_counter()
    for _ in range(new):  # greedy: the argmax of the last row's logits (the Python sampler costs more)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    return {"decode_tok_s": new / (time.perf_counter() - t), "tokens": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b", choices=sorted(shapes.SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--worker", choices=("turbo", "llama.cpp"))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.shape, args.threads, args.new)))
        return
    shapes.build(args.shape, quant="int4")
    q4_gguf(args.shape)
    seen: dict[str, list[float]] = {"turbo": [], "llama.cpp": []}
    for _ in range(args.reps):
        for system in seen:
            cmd = [sys.executable, __file__, "--worker", system, "--shape", args.shape, "--threads",
                   str(args.threads), "--new", str(args.new)]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            seen[system].append(r["decode_tok_s"])
    for system, v in seen.items():
        print(f"{system:10s} int4 / Q4_0 decode tok/s: median {statistics.median(v):.1f} "
              f"[{min(v):.1f}, {max(v):.1f}] over {len(v)}")
    print(f"turbo / llama.cpp: {statistics.median(seen['turbo']) / statistics.median(seen['llama.cpp']):.2f}x")


if __name__ == "__main__":
    main()
