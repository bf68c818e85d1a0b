"""One matrix product of the native step, read from memory and from the caches, per row count.

    python -m scripts.bench_products [--n 7168] [--k 1024] [--format bf16 int4 int8] [--rows 1 9]
        [--threads 1 2]
    python -m scripts.bench_products --n 1024 --k 3584 --format int4 int4g128 int4g32 int8g32 fp8 bf16

Why: a verify of R rows costs about one decode step only while its products stay bound by
reading the weights. "memory": the product over copies of the matrix that together exceed the
caches (--cold-mb), one after another, so that every byte comes from memory as in a step;
"cached": one copy over and over, so that only the arithmetic is left. The two say how far a
product of R rows is from each limit. Medians of --reps interleaved runs (min..max), ms per
product, with the bytes/s and multiply-adds/s they mean. Default shape: the 0.8B MLP's
gate_up (7168 x 1024). Formats: turbo's own (bf16 panel pairs, wtype 6; int4 / int8 in groups
of 64, wtypes 4 / 5), fp32 panels, and the converted installs' exact ones read as stored
(native_exact.py: int4g32 / int4g128 / int8g32, wtype 8; q8_0: int8g32 of Q8_0's scales, read
centered; fp8, wtype 9). A benchmark, not a
test: time it under the machine's bench lock.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from scripts import benchlib
from turbo.backends import native_exact, native_lib, native_pack
from turbo.backends.packed import Packed
from turbo.store import quant

BITS = {"int4": 4, "int8": 8}
CODE = {"int4": 4, "int8": 5}  # their quantization codes (groups of 64: the native step's)
EXACT = {"int4g32": quant.EXACT_INT4[32], "int4g128": quant.EXACT_INT4[128], "int8g32": quant.GGUF_FORMATS["int8g32"]}
FORMATS = ("bf16", "fp32", *BITS, *EXACT, "q8_0", "fp8")


def q8_0(w: torch.Tensor) -> quant.QuantizedWeight:
    """int8g32 as a GGUF's Q8_0 converts to it (f16 scale d = amax / 127, bias -128 d): packed
    centered (native_exact.centered), where int8g32 from turbo's quantizer is not."""
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    d = (g.abs().amax(-1) / 127).half().float()
    q = (torch.round(g / torch.where(d == 0, 1, d)[..., None]).clamp(-128, 127) + 128).to(torch.uint8)
    return quant.QuantizedWeight(quant.pack(q.reshape(n, k), 8), d, -128 * d, 8, 32)


def fp8(n: int, k: int) -> quant.QuantizedWeight:
    """Random e4m3 codes (no NaN) with a scale per 128 x 128 block, as turbo/repack/fp8.py keeps them."""
    from turbo.repack import fp8 as repack_fp8
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    scale_inv = torch.rand(-(-n // 128), k // 128, generator=g) * 0.01
    return quant.QuantizedWeight(*repack_fp8.fp8_install(codes.view(torch.float8_e4m3fn), scale_inv, (128, 128)),
                                 8, 128, float8=True)


def packed(fmt: str, n: int, k: int) -> Packed:
    if fmt == "fp8":
        return native_exact.exact_panels(fp8(n, k))
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    if fmt in ("bf16", "fp32"):
        dtype, layout = (torch.bfloat16, "panel_pairs") if fmt == "bf16" else (torch.float32, "panels")
        return native_pack.pack_rows(lambda r0, r1: w[r0:r1], n, dtype, layout)
    if fmt == "q8_0":
        return native_exact.exact_panels(q8_0(w))
    f = EXACT.get(fmt) or quant.format_for(code=CODE[fmt])
    q = quant.QuantizedWeight(*quant.quantize(w, f), bits=f.bits, group=f.group)
    return native_exact.exact_panels(q) if fmt in EXACT else native_pack.quantized_panels(q)


def per_product(x: torch.Tensor, ws: list[Packed], calls: int) -> float:
    """Seconds per product, over `calls` passes through ws."""
    lib, y = native_lib.threaded(), torch.empty(x.shape[0], ws[0].n)
    t = time.perf_counter()
    for _ in range(calls):
        for w in ws:
            lib.linear_packed(x.data_ptr(), x.shape[0], w.k, w.data.data_ptr(), w.wtype, w.n, y.data_ptr())
    return (time.perf_counter() - t) / (calls * len(ws))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--format", nargs="+", default=["bf16", "int4"], choices=FORMATS)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 9])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cold-mb", type=int, default=600, help="the copies' total size (past the caches)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if native_lib.library() is None:
        raise SystemExit(f"the native library is unavailable: {native_lib.why_not()}")
    one = {f: packed(f, args.n, args.k) for f in args.format}
    copies = {f: [one[f]] + [Packed(w.data.clone(), w.n, w.k, w.layout)
                             for _ in range(max(1, args.cold_mb * 2 ** 20 // w.data.nbytes) - 1)]
              for f, w in one.items()}
    xs = {r: torch.randn(r, args.k, generator=torch.Generator().manual_seed(1)) for r in args.rows}
    cases = [(f, r, t) for f in args.format for r in args.rows for t in args.threads]
    times = {c: {"memory": [], "cached": []} for c in cases}
    guard, seen = benchlib.Guard.from_env(max(args.threads)), []
    for rep in range(args.reps):
        for f, r, t in cases:
            torch.set_num_threads(t)
            with guard.rep(f"rep {rep} {f} {r} rows {t} threads") as g:
                mem = per_product(xs[r], copies[f], 1)
                hot = per_product(xs[r], [one[f]], max(2, min(200, 2 ** 28 // one[f].data.nbytes)))
            seen.append({"guard": dataclasses.asdict(g)})
            if not g.disturbed:  # a disturbed one is dropped (benchlib.Guard)
                times[f, r, t]["memory"].append(mem)
                times[f, r, t]["cached"].append(hot)
    print(f"{args.n} x {args.k}, copies past the caches: {args.cold_mb} MB; medians of the undisturbed of "
          f"{args.reps} (min..max)")
    print(benchlib.guard_summary(seen))
    print("| format | rows | threads | from memory, ms | GB/s | from the caches, ms | GMAC/s | memory / cached |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (f, r, t), d in times.items():
        if not d["memory"]:
            print(f"| {f} | {r} | {t} | - (every repetition disturbed) | | | | |")
            continue
        mem, hot = statistics.median(d["memory"]), statistics.median(d["cached"])
        spread = lambda xs: f"{statistics.median(xs) * 1e3:.3f} ({min(xs) * 1e3:.3f}..{max(xs) * 1e3:.3f})"  # noqa: E731
        print(f"| {f} | {r} | {t} | {spread(d['memory'])} | {one[f].data.nbytes / mem / 1e9:.1f} | "
              f"{spread(d['cached'])} | {r * args.n * args.k / hot / 1e9:.0f} | {mem / hot:.2f} |")


if __name__ == "__main__":
    main()
