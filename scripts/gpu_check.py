"""The GPU checks of the cuda backend in one short run (< 5 minutes on an H200).

    OUT=DIR python -m scripts.gpu_check   # results go to $OUT (default build/gpu_check)

Writes to $OUT:
    env.txt         nvidia-smi, driver / torch / cuda-python versions, cuda_unavailable_reason()
    pytest.txt      python -m pytest tests/test_cuda.py tests/test_cuda_engine.py -rs (the GPU tests
                    run here, unskipped: each kernel against its reference, and the whole engine on
                    backend=cuda committing the CPU backend's tokens for blocks 1..8, both rollbacks)
    junit.xml       the same as JUnit XML
    bench.json      decode micro-benchmark: a Qwen3.5-shaped GDN layer step (int4 in_proj GEMV,
                    conv window, recurrence, gated norm, int4 out_proj) for 1 row (decode) and
                    9 rows with checkpoints (verify of block 8), eager and CUDA-graph replay,
                    plus the selector over a 248320 vocab; the tokens/s lines extrapolate to
                    `layers` GDN layers (the attention layers, MLPs and lm_head are not in it)
    engine.json     the whole engine on backend=cuda (eager: no CUDA graphs on the engine path):
                    per install (the embedded `tiny` when shipped, a random small install, a random
                    mid-size one), decode tokens/s (policy off) and speculative tokens/s (fixed
                    blocks 2/4/8, DFlash2; random drafters accept next to nothing, so there it is
                    the round's cost, and `_all_accepted` repeats blocks 4/8 with a scripted
                    drafter proposing the trunk's own continuation: the ceiling) as the engine's
                    Stats report them, the trunk's own
                    ms per decode step (1 row) and per verify (9 rows + checkpoint rollback), the
                    same decode with the PTX kernels switched off (torch ops on the GPU), and the
                    CPU backend's decode tokens/s on the same install for scale
    rows_products.json  bgemv.cu (the batch-invariant bf16 / int8 products, device-unverified before
                    this runs) at the 0.8B's matrices ([3584 x 1024], [1024 x 3584], the lm head
                    [248320 x 1024]): `batch_invariant` (3-, 6-, 9- and 16-row products bit for
                    bit equal to each row alone), the max error against an fp64 product next to
                    torch's own, GB/s of weights read for 1 and 9 rows and that as a fraction of the
                    measured device-to-device copy bandwidth (`d2d_copy_GBps`, read + write bytes)
                    (runs last: a kernel fault there cannot spoil the other results)
    cuda_step.json  the CUDA step (turbo/backends/cuda_step) on a random 2-layer install, eager and
                    graphed on the device and on the simulated device (TURBO_CUDA_SIM's CUDA C on the
                    host) with the same tokens: bit-equality eager vs graphed and device vs simulated
                    (else the max differences), ms per decode step eager and graphed
    summary.json    pass/fail counts and the headline numbers
Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sh(cmd: list[str], timeout: int = 60) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (res.stdout + res.stderr).strip()
    except Exception as e:  # noqa: BLE001
        return f"{cmd[0]}: {e}"


def env_report(out: Path) -> str | None:
    import torch

    from turbo.backends.cuda import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    lines = [sh(["nvidia-smi"]), f"python {sys.version}", f"torch {torch.__version__} cuda {torch.version.cuda} "
             f"available {torch.cuda.is_available()}"]
    try:
        import cuda.bindings
        from cuda.bindings import driver
        lines.append(f"cuda-python {cuda.bindings.__version__}")
        driver.cuInit(0)
        lines.append(f"driver CUDA version {driver.cuDriverGetVersion()[1]}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"cuda-python: {e}")
    if torch.cuda.is_available():
        lines.append(f"device {torch.cuda.get_device_name()} cc {torch.cuda.get_device_capability()}")
    lines.append(f"cuda_unavailable_reason(): {reason}")
    (out / "env.txt").write_text("\n".join(lines) + "\n")
    return reason


def timed(fn, iters: int) -> float:
    """Median-free simple mean of `iters` calls, seconds per call (synchronised)."""
    import torch

    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def graphed(fn):
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def bench(out: Path) -> dict:
    import torch

    from turbo.backends import cuda as cb
    from turbo.backends import ops
    from turbo.store import quant

    torch.manual_seed(0)
    dev = "cuda"
    hidden, hk, hv, d, taps, layers = 4096, 16, 32, 128, 4, 48
    conv_c = 2 * hk * d + hv * d
    proj_out = conv_c + hv * d + 2 * hv  # qkv | z | b | a

    def qweight(o, i, bits=4, group=64):
        w = torch.randn(o, i) * 0.02
        g = w.reshape(o, i // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        sdt = torch.bfloat16 if bits == 4 else torch.float16
        scales, biases = ((hi - lo) / ((1 << bits) - 1)).to(sdt), lo.to(sdt)
        q = ((g - biases.float()[..., None]) / scales.float()[..., None].clamp_min(1e-8)).round().clamp(0, (1 << bits) - 1)
        per = 32 // bits
        words = (q.reshape(o, i // per, per).long() << (torch.arange(per) * bits)).sum(-1)
        packed = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
        return packed.to(dev), scales.to(dev), biases.to(dev)

    in_proj, out_proj = qweight(proj_out, hidden), qweight(hidden, hv * d)
    in_deq = quant.dequantize(*in_proj, 4, 64, torch.bfloat16)
    out_deq = quant.dequantize(*out_proj, 4, 64, torch.bfloat16)
    conv_w = torch.randn(conv_c, taps, device=dev) * 0.3
    norm_w = torch.randn(d, device=dev)
    state = torch.randn(hv, d, d, device=dev) * 0.1
    window = torch.randn(taps - 1, conv_c, device=dev)
    results: dict = {"shape": {"hidden": hidden, "key_heads": hk, "value_heads": hv, "head_dim": d, "taps": taps,
                               "layers_extrapolated": layers, "weights": "int4 group 64 bf16 scales"}}

    def layer_step(rows: int, keep: bool, kernels: bool):
        x = torch.randn(rows, hidden, device=dev)

        def run():
            if kernels:
                proj = cb.affine_linear(x, *in_proj, 4, 64)
            else:
                proj = torch.nn.functional.linear(x.to(torch.bfloat16), in_deq).float()
            qkv, z = proj[:, :conv_c], proj[:, conv_c:conv_c + hv * d]
            b, a = proj[:, conv_c + hv * d:conv_c + hv * d + hv], proj[:, conv_c + hv * d + hv:]
            if kernels:
                mixed, _, _ = cb.conv_window_update(window, qkv, conv_w, keep_ext=keep)
            else:
                mixed = ops.causal_conv_rows(torch.cat([window, qkv]), conv_w)
            q = ops.l2norm(mixed[:, :hk * d].reshape(rows, hk, d)).repeat_interleave(hv // hk, 1) * d ** -0.5
            k = ops.l2norm(mixed[:, hk * d:2 * hk * d].reshape(rows, hk, d)).repeat_interleave(hv // hk, 1)
            v = mixed[:, 2 * hk * d:].reshape(rows, hv, d)
            g = -torch.nn.functional.softplus(a)
            beta = torch.sigmoid(b)
            if kernels:
                o, _, _ = cb.gdn_recurrence(state, q, k, v, g, beta, keep_states=keep)
                y = cb.gated_rms_norm(o, z.reshape(rows, hv, d), norm_w, 1e-6)
                return cb.affine_linear(y.reshape(rows, -1), *out_proj, 4, 64)
            o, _, _ = ops.gdn_recurrence(state, q, k, v, g, beta, keep_states=keep)
            y = ops.gated_rms_norm(o, z.reshape(rows, hv, d), norm_w, 1e-6)
            return torch.nn.functional.linear(y.reshape(rows, -1).to(torch.bfloat16), out_deq).float()
        return run

    for label, rows, keep in (("decode", 1, False), ("verify_block8", 9, True)):
        for impl, kernels in (("ptx_kernels", True), ("torch_only", False)):
            step = layer_step(rows, keep, kernels)
            eager = timed(step, 50)
            replay = timed(graphed(step), 200)
            per_token_stack = replay * layers
            results[f"{label}.{impl}"] = {
                "rows": rows, "eager_us_per_layer": round(eager * 1e6, 1),
                "graph_us_per_layer": round(replay * 1e6, 1),
                "gdn_stack_ms_graph": round(per_token_stack * 1e3, 3),
                # decode: one token per step; verify: one round of 9 rows (tokens it may commit: 1..9)
                "gdn_stack_steps_per_s_graph": round(1.0 / per_token_stack, 1),
            }

    vocab, rank = 248_320, 256
    logits = torch.randn(8, vocab, device=dev)
    proj = torch.randn(8, rank, device=dev)
    pred_cb, succ_cb = torch.randn(vocab, rank, device=dev), torch.randn(vocab, rank, device=dev)
    sel = lambda: cb.select_candidates_ids(logits, proj, 3, pred_cb, succ_cb, 16)  # noqa: E731
    results["selector_b8_vocab248320_us"] = round(timed(sel, 50) * 1e6, 1)
    results["selector_b8_vocab248320_graph_us"] = round(timed(graphed(sel), 200) * 1e6, 1)
    h = torch.randn(9, 5120, device=dev)
    base, dyn = torch.randn(2, 5120, device=dev), torch.randn(9, 2, 5120 // 16, device=dev)
    results["grouped_conv_9x5120_us"] = round(timed(lambda: cb.grouped_conv(h, base, dyn, 16), 100) * 1e6, 1)
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def engine_bench(out: Path, budget_s: float = 75.0) -> dict:
    """Decode and speculative tokens/s of the whole engine on backend=cuda (see the docstring)."""
    import tempfile

    import turbo
    from turbo.backends import ops
    from turbo.store.install import BUNDLED_DIR
    from turbo.testing import ScriptedDrafter, make_spec_install

    t_end = time.time() + budget_s
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    installs = []
    if (BUNDLED_DIR / "tiny" / "config.json").is_file():
        installs.append(("tiny (embedded)", "tiny"))
    installs.append(("random small (hidden 64, 4 layers, vocab 320)", make_spec_install(tmp / "small", 0)[1]))
    mid = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
               linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=32000)
    results: dict = {"launch_overhead": "eager launches; CUDA graphs are not used on the engine path"}

    def measure(label, path):
        rt = turbo.open(path, backend="cuda")
        prompt = list(range(5, 69)) if label.startswith("random") else rt.encode("def fibonacci(n):\n    ")
        new = 96
        rt.generate(prompt, max_new_tokens=8, policy="off")  # warm: module loads, calibration, allocator
        r: dict = {}
        plain = rt.generate(prompt, max_new_tokens=new, policy="off", stop_at_eos=False)
        r["decode_tokens_per_s"] = round(plain.stats.decode_tokens_per_s, 1)
        if rt.install.has_dflash:
            for block in (2, 4, 8):
                res = rt.generate(prompt, max_new_tokens=new, policy="fixed", block=block, stop_at_eos=False)
                r[f"speculative_b{block}"] = {"tokens_per_s": round(res.stats.decode_tokens_per_s, 1),
                                              "accepted_per_round": round(res.stats.accepted_per_round, 2),
                                              "same_tokens_as_plain": res.tokens == plain.tokens}
            for block in (4, 8):
                scripted = ScriptedDrafter(prompt + plain.tokens, [block], rt.install.arch.vocab)
                res = rt.generate(prompt, max_new_tokens=new, policy="fixed", block=block, stop_at_eos=False,
                                  drafter=scripted)
                r[f"speculative_b{block}_all_accepted"] = {
                    "tokens_per_s": round(res.stats.decode_tokens_per_s, 1),
                    "accepted_per_round": round(res.stats.accepted_per_round, 2),
                    "same_tokens_as_plain": res.tokens == plain.tokens}
        trunk = rt.trunk
        st = trunk.new_state(len(prompt) + 4096)
        trunk.prefill(st, prompt)
        r["trunk_decode_step_ms"] = round(timed(lambda: trunk.step(st, [7]), 50) * 1e3, 3)

        def verify():
            o = trunk.step(st, [7] * 9, rollback="checkpoint")
            trunk.rollback(st, o, 9, 1, "checkpoint")
        r["trunk_verify9_plus_rollback_ms"] = round(timed(verify, 30) * 1e3, 3)
        ops.CUDA_KERNELS = False
        try:
            off = turbo.open(path, backend="cuda")
            off.generate(prompt, max_new_tokens=8, policy="off")
            res = off.generate(prompt, max_new_tokens=new, policy="off", stop_at_eos=False)
            r["decode_tokens_per_s_torch_ops_only"] = round(res.stats.decode_tokens_per_s, 1)
            r["torch_ops_only_same_tokens"] = res.tokens == plain.tokens
        finally:
            ops.CUDA_KERNELS = True
        cpu = turbo.open(path, backend="cpu")
        res = cpu.generate(prompt, max_new_tokens=32, policy="off", stop_at_eos=False)
        r["cpu_backend_decode_tokens_per_s"] = round(res.stats.decode_tokens_per_s, 1)
        r["cpu_same_first_32_tokens"] = res.tokens == plain.tokens[:32]
        return r

    for label, path in installs:
        try:
            results[label] = measure(label, path)
        except Exception as e:  # noqa: BLE001 - one install's failure must not hide the others
            results[label] = {"error": f"{type(e).__name__}: {e}"}
        (out / "engine.json").write_text(json.dumps(results, indent=2) + "\n")
    label = "random mid (hidden 1024, 8 layers, vocab 32000)"
    if time.time() < t_end - 30:
        try:
            results[label] = measure(label, make_spec_install(tmp / "mid", 1, **mid)[1])
        except Exception as e:  # noqa: BLE001
            results[label] = {"error": f"{type(e).__name__}: {e}"}
    else:
        results[label] = {"skipped": f"over the {budget_s:.0f} s budget"}
    (out / "engine.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


ROWS_SHAPES = {"mlp_up_3584x1024": (3584, 1024), "mlp_down_1024x3584": (1024, 3584),
               "lm_head_248320x1024": (248_320, 1024)}  # the 0.8B's (hidden 1024)


def rows_products(out: Path, dev: str = "cuda", shapes: dict = ROWS_SHAPES, copy_bytes: int = 1 << 30,
                  iters: int = 20) -> dict:
    """bgemv.cu on the device: batch invariance, error and bandwidth (see the docstring)."""
    import torch

    from turbo.backends import cuda as cb
    from turbo.store import quant

    torch.manual_seed(0)
    res: dict = {"kernels": dict(cb.ROWS_KERNELS)}
    n = copy_bytes
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    copy_s = timed(lambda: b.copy_(a), 20)
    del a, b
    copy_gbps = 2 * n / copy_s / 1e9  # bytes read + bytes written
    res["d2d_copy_GBps"] = round(copy_gbps, 1)
    for fmt in ("bf16", "int8"):
        for label, (o, i) in shapes.items():
            r: dict = {}
            res[f"{fmt}.{label}"] = r
            x = torch.randn(16, i, device=dev)
            if fmt == "bf16":
                w = (torch.randn(o, i, device=dev) * 0.02).to(torch.bfloat16)
                fn = lambda rows, w=w: cb.bf16_rows_product(rows, w)  # noqa: E731
                wf, weight_bytes = w.float(), w.numel() * 2
            else:
                packed = torch.randint(-2 ** 31, 2 ** 31, (o, i // 4), dtype=torch.int32, device=dev)
                scales = (torch.rand(o, i // 64, device=dev) * 1e-3 + 1e-4).to(torch.bfloat16)
                biases = (-128 * scales.float()).to(torch.bfloat16)
                fn = lambda rows, p=packed, s=scales, bb=biases: cb.int8_rows_product(rows, p, s, bb, 64)  # noqa: E731
                wf = quant.dequantize(packed, scales, biases, 8, 64)
                weight_bytes = packed.numel() * 4 + 2 * scales.numel() * 2
            alone = torch.cat([fn(x[k:k + 1]) for k in range(16)])
            # each row alone (pass size 1) against 3, 6, 9 and 16 rows (pass sizes 4, 8, 16, 16)
            r["batch_invariant"] = all(bool(torch.equal(fn(x[:k]), alone[:k])) for k in (3, 6, 9, 16))
            ref = x.double() @ wf.double().T
            r["max_abs_err_vs_fp64"] = float((alone.double() - ref).abs().max())
            r["torch_fp32_max_abs_err_vs_fp64"] = float(((x @ wf.T).double() - ref).abs().max())
            r["max_abs_ref"] = float(ref.abs().max())
            del ref, wf
            for rows in (1, 9, 16):
                t = timed(lambda rows=rows: fn(x[:rows]), iters)
                gbps = weight_bytes / t / 1e9
                r[f"rows{rows}_kernel"] = cb.rows_kernel(fmt, rows)
                r[f"rows{rows}_us"] = round(t * 1e6, 1)
                r[f"rows{rows}_weight_GBps"] = round(gbps, 1)
                r[f"rows{rows}_of_copy"] = round(gbps / copy_gbps, 3)
            (out / "rows_products.json").write_text(json.dumps(res, indent=2) + "\n")
    # torch's own bf16 product, for scale: is its row 0 the same at 1 and 9 rows?
    w = (torch.randn(3584, 1024, device=dev) * 0.02).to(torch.bfloat16)
    x = torch.randn(9, 1024, device=dev).to(torch.bfloat16)
    lin = torch.nn.functional.linear
    res["torch_bf16_linear_row0_same_at_1_and_9_rows"] = bool(torch.equal(lin(x[:1], w), lin(x, w)[:1]))
    (out / "rows_products.json").write_text(json.dumps(res, indent=2) + "\n")
    return res


def _step_outputs(trunk, dev, graphs: bool, prompt: list[int], steps: list[int], block: list[int]) -> list:
    """The CUDA step's outputs on `dev` (prefill, decode steps, a verify of `block` with checkpoints):
    [(name, tensor)] in order, and the step's own launches a decode step."""
    from turbo.backends.cuda_step.step import CudaTrunkStep

    cs = CudaTrunkStep(trunk, dev, capacity=64, graphs=graphs)
    st = trunk.new_state(64)
    outs = [("prefill.logits", cs.prefill(st, prompt, (), True).logits)]
    for i, t in enumerate(steps):
        o = cs.step(st, [t], (), None)
        outs += [(f"step{i}.logits", o.logits), (f"step{i}.hidden", o.hidden)]
    v = cs.step(st, block, (), "checkpoint")
    outs += [("verify.logits", v.logits), ("verify.hidden", v.hidden)]
    cs.close()
    return outs


def cuda_step_check(out: Path, device=None, sim=None, time_iters: int = 50) -> dict:
    """The CUDA step (turbo/backends/cuda_step) on the device, eager and graphed, against the simulated
    device (turbo/backends/cuda_sim: the same kernels' CUDA C on the host) on the same random 2-layer
    install and tokens: every output bit-equal eager vs graphed on the device, and device vs simulated
    (else the max difference); then ms per decode step eager and graphed (the device's, `time_iters`
    steps). `device`/`sim`: the launchers (default: cuda_kernels.kernels(0) and a HostDevice)."""
    import tempfile

    import torch

    from turbo.backends import cuda_kernels
    from turbo.backends.cuda_step.step import CudaTrunkStep
    from turbo.load.loader import load_trunk
    from turbo.sequence.options import OpenOptions
    from turbo.store.install import open_install
    from turbo.testing import make_install
    from turbo.testing.host_cuda import HostDevice

    device = device if device is not None else cuda_kernels.kernels(0)
    sim = sim if sim is not None else HostDevice()
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_step_"))
    _, path = make_install(tmp, 3, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                           linear_key_head_dim=64, linear_value_head_dim=64)
    trunk = load_trunk(open_install(path), OpenOptions(dtype="bfloat16", kv_cache="float32"), "cpu")
    prompt, steps, block = [5, 17, 99, 3, 250], [7, 8, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48]
    runs = {"device_eager": _step_outputs(trunk, device, False, prompt, steps, block),
            "device_graphed": _step_outputs(trunk, device, True, prompt, steps, block),
            "simulated": _step_outputs(trunk, sim, False, prompt, steps, block)}

    def compare(a: str, b: str) -> dict:
        diffs = {n: float((x - y).abs().max()) for (n, x), (_, y) in zip(runs[a], runs[b]) if not torch.equal(x, y)}
        return {"bit_equal": not diffs, "max_abs_diff": diffs}

    res = {"eager_vs_graphed": compare("device_eager", "device_graphed"),
           "device_vs_simulated": compare("device_eager", "simulated")}
    for graphs in (False, True):  # ms per decode step on the device (each step syncs once: the download)
        cs = CudaTrunkStep(trunk, device, capacity=time_iters + 16, graphs=graphs)
        st = trunk.new_state(time_iters + 16)
        cs.prefill(st, prompt, (), False)
        cs.step(st, [7], (), None)  # the graph's capture (graphed), off the clock
        t = time.perf_counter()
        for i in range(time_iters):
            cs.step(st, [(i * 13) % 300 + 3], (), None)
        res[f"decode_ms_{'graphed' if graphs else 'eager'}"] = (time.perf_counter() - t) / time_iters * 1e3
        cs.close()
    (out / "cuda_step.json").write_text(json.dumps(res, indent=2) + "\n")
    return res


def main() -> int:
    out = Path(os.environ.get("OUT") or ROOT / "build" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    reason = env_report(out)
    summary: dict = {"cuda_unavailable_reason": reason}
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_cuda.py"),
           str(ROOT / "tests" / "test_cuda_engine.py"), "-q", "-rs", "--durations=10", "-p", "no:cacheprovider", f"--junitxml={out / 'junit.xml'}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=200)
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # keep what it printed; the benchmarks still run
        text = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        text, code = text + "\n[gpu_check] pytest passed its 200 s limit\n", 124
    (out / "pytest.txt").write_text(text)
    summary["pytest_exit"] = code
    summary["pytest_tail"] = (text.strip().splitlines() or [""])[-1]
    if reason is None:
        try:
            summary["bench"] = bench(out)
        except Exception as e:  # noqa: BLE001 - report, don't hide the pytest result
            summary["bench_error"] = f"{type(e).__name__}: {e}"
        try:
            summary["engine"] = engine_bench(out)
        except Exception as e:  # noqa: BLE001
            summary["engine_error"] = f"{type(e).__name__}: {e}"
        try:  # the CUDA step eager / graphed / simulated (device-unverified before this runs)
            summary["cuda_step"] = cuda_step_check(out)
        except Exception as e:  # noqa: BLE001
            summary["cuda_step_error"] = f"{type(e).__name__}: {e}"
        try:  # last: a fault in the device-unverified kernels must not spoil the results above
            summary["rows_products"] = rows_products(out)
        except Exception as e:  # noqa: BLE001
            summary["rows_products_error"] = f"{type(e).__name__}: {e}"
    else:
        summary["bench_skipped"] = reason
    summary["wall_s"] = round(time.time() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return code


if __name__ == "__main__":
    # no options; --help must print this docstring, not run the script
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit(main())
