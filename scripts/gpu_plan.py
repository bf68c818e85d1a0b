"""The CUDA step's cost plan (issue #55, item 3): a random install at a shape's real widths with a few
layers, its CUDA step (turbo/backends/cuda_step) run on the simulated device (TURBO_CUDA_SIM), and
per step: launches per layer and per step, the kernels' unique bytes read and written against the
floor (weights as stored + GDN state + the K/V before the rows), and the step time those imply at
each card's bandwidth with a per-launch cost, scaled to the shape's full layer count. Nothing timed.

    python -m scripts.gpu_plan --shape qwen3.5-0.8b [--quant int4] [--rows R] [--layers N]
                               [--context P] [--vocab V] [--markdown FILE]

--layers N (default 2): the first N of the shape's layer types, the last one made full attention
if none is (the plan needs one of each kind; MoE shapes: both are routed). --context P (default 16):
the position of the measured step (the prompt before it, prefilled on the simulated device); the
K/V read grows linearly past it, stated per 1k positions. --vocab V (default 4096): the lm_head
simulated at V rows (the simulated products are slow at 248320 x H); its launches and bytes are
those of V rows scaled by the shape's vocab / V (a rows product reads each row once: linear).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TURBO_CUDA_SIM", "1")  # before turbo.backends loads the driver stand-in

import torch

from turbo.backends.cuda_step import plan
from turbo.backends.cuda_step.step import CudaTrunkStep
from turbo.load.loader import load_trunk
from turbo.repack import repack
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install
from turbo.testing.host_cuda import HostDevice
from turbo.testing.shapes import FULL_EVERY_4, SHAPES, write_checkpoint

_ROPE = dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25)
# Qwen3.5's published text configs (Qwen3_5TextConfig fields). 27B: hidden 5120, 64 layers, 24 / 4
# heads of 256, GDN 16 key / 48 value heads of 128, MLP 17408. 9B: hidden 4096, 32 layers, 16 / 4 heads
# of 256, MLP 12288; its GDN heads (16 key / 32 value of 128) from recollection of the config, not a
# checked copy of it.
PLAN_SHAPES: dict[str, dict] = {
    "qwen3.5-0.8b": SHAPES["qwen3.5-0.8b"],
    "qwen3.5-9b": dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       layer_types=FULL_EVERY_4(32), num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                       rms_norm_eps=1e-6, max_position_embeddings=262144, rope_parameters=_ROPE),
    "qwen3.5-27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        layer_types=FULL_EVERY_4(64), num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                        rms_norm_eps=1e-6, max_position_embeddings=262144, rope_parameters=_ROPE),
    # the 35B-A3B's widths (turbo.testing.shapes' 2-layer slice) at its 40 layers
    "qwen3.5-35b-a3b": {**SHAPES["qwen3.5-35b-a3b-2l"], "num_hidden_layers": 40, "layer_types": FULL_EVERY_4(40)},
}
MOE = {"qwen3.5-35b-a3b"}
GB = 1e9


def slice_shape(shape: dict, layers: int, vocab: int) -> dict:
    types = list(shape["layer_types"][:layers])
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return {**shape, "num_hidden_layers": layers, "layer_types": types, "vocab_size": vocab}


def build(shape: dict, moe: bool, quant: str, directory: Path):
    hf, install = directory / "hf", directory / "install"
    write_checkpoint(hf, shape, seed=0, moe=moe)
    repack(hf, install, quiet=True, quant=quant)
    opts = OpenOptions(dtype="bfloat16", kv_cache="float32") if quant == "none" else \
        OpenOptions(kv_cache="float32", native=False, quant_cpu="packed")
    return load_trunk(open_install(install), opts, "cpu")


def run(name: str, quant: str, rows: int, layers: int, context: int, vocab: int) -> dict:
    full = PLAN_SHAPES[name]
    shape = slice_shape(full, layers, vocab)
    with tempfile.TemporaryDirectory() as tmp:
        trunk = build(shape, name in MOE, quant, Path(tmp))
        cs = CudaTrunkStep(trunk, HostDevice(), capacity=max(64, context + rows + 1))
        st = trunk.new_state(cs.capacity)
        prompt = [(7 * i) % (vocab - 1) + 1 for i in range(context)]
        cs.prefill(st, prompt, (), False)
        tokens = [(11 * i + 3) % (vocab - 1) + 1 for i in range(rows)]
        cost = plan.measure(cs, st, tokens, "checkpoint" if rows > 1 else None)
        fl = plan.floor(cs, context, rows, rows)
        cs.close()
    types = shape["layer_types"]
    per = {}  # layer kind -> (launches, read, written, floor of that kind's layers) from the measured layers
    for kind in ("linear_attention", "full_attention"):
        idx = [i for i, t in enumerate(types) if t == kind]
        parts = [cost.layers[i] for i in idx]
        per[kind] = dict(n_full=full["layer_types"].count(kind), launches=parts[0].launches,
                         read=sum(p.read for p in parts) / len(parts), written=sum(p.written for p in parts) / len(parts),
                         kernels=parts[0].kernels)
    scale = full["vocab_size"] / vocab  # the lm_head's rows (the head's other bytes are a few kB)
    head_read = cost.head.read * scale
    head_written = cost.head.written * scale
    n_full = full["num_hidden_layers"]
    launches = cost.head.launches + sum(p["n_full"] * p["launches"] for p in per.values())
    read = head_read + sum(p["n_full"] * p["read"] for p in per.values())
    written = head_written + sum(p["n_full"] * p["written"] for p in per.values())
    # the floor at full depth: per-kind floors are the measured slice's, the head's scaled like it
    n_gdn = per["linear_attention"]["n_full"]
    n_att = per["full_attention"]["n_full"]
    gdn_layers = sum(1 for t in types if t == "linear_attention")
    att_layers = len(types) - gdn_layers
    layer_w = fl.weights - fl.head
    # split the slice's layer weights by kind from its layers' matrices (floor() per layer)
    w_by = _weights_by_kind(cs, rows)
    floor_w = fl.head * scale + n_gdn * w_by["linear_attention"] / max(1, gdn_layers) \
        + n_att * w_by["full_attention"] / max(1, att_layers)
    assert abs(sum(w_by.values()) - layer_w) < 1e-6 * max(1, layer_w)
    floor_state = fl.state / max(1, gdn_layers) * n_gdn
    floor_kv = fl.kv / max(1, att_layers) * n_att
    kv_per_1k = 2 * 4 * full["num_key_value_heads"] * full["head_dim"] * 1000 * n_att
    return dict(shape=name, quant=quant, rows=rows, sim_layers=len(types), context=context, sim_vocab=vocab,
                layers=n_full, per=per, head_launches=cost.head.launches, launches=launches, read=read,
                written=written, floor=floor_w + floor_state + floor_kv, floor_weights=floor_w,
                floor_state=floor_state, floor_kv=floor_kv, kv_per_1k=kv_per_1k,
                slice_ratio=cost.read / fl.total, copies=cost.copies, copy_bytes=cost.copy_bytes)


def _weights_by_kind(cs: CudaTrunkStep, rows: int) -> dict[str, float]:
    """The floor's layer weights split by the layer's kind (plan.floor over one layer at a time)."""
    out = {"linear_attention": 0.0, "full_attention": 0.0}
    layers = cs.layers
    for L in layers:
        cs.layers = [L]
        f = plan.floor(cs, 0, rows, rows)
        out["linear_attention" if L["gdn"] else "full_attention"] += f.weights - f.head
    cs.layers = layers
    return out


def table(results: list[dict]) -> str:
    lines = [("| shape | quant | rows | launches / layer (GDN, attn) | launches / step | read / step | written / step "
              "| floor (weights + state + K/V) | read / floor | H100 3.35 TB/s | H200 4.8 TB/s |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        per = r["per"]
        times = []
        for bw in (plan.CARDS["H100"], plan.CARDS["H200"]):
            t = plan.step_seconds(r["read"] + r["written"], r["launches"], bw)
            times.append(f"{t * 1e3:.2f} ms ({r['rows'] / t:,.0f} tok/s)")
        lines.append(
            f"| {r['shape']} | {r['quant']} | {r['rows']} | {per['linear_attention']['launches']}, "
            f"{per['full_attention']['launches']} | {r['launches']} | {r['read'] / GB:.3f} GB | "
            f"{r['written'] / GB:.4f} GB | {r['floor'] / GB:.3f} GB ({r['floor_weights'] / GB:.3f} + "
            f"{r['floor_state'] / GB:.3f} + {r['floor_kv'] / GB:.4f}) | {r['read'] / r['floor']:.3f} | "
            f"{times[0]} | {times[1]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, choices=sorted(PLAN_SHAPES))
    ap.add_argument("--quant", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--markdown", type=Path, help="append the table row's markdown to this file")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    r = run(args.shape, args.quant, args.rows, args.layers, args.context, args.vocab)
    md = table([r])
    print(md)
    print(f"\nsimulated: {r['sim_layers']} layers (kernels a GDN layer: {', '.join(r['per']['linear_attention']['kernels'])}; "
          f"an attention layer: {', '.join(r['per']['full_attention']['kernels'])}), head {r['head_launches']} launches, "
          f"position {r['context']}, lm_head at {r['sim_vocab']} rows scaled to the vocab; the slice's own read / floor "
          f"{r['slice_ratio']:.3f}; copies a step: {r['copies']} ({r['copy_bytes']} bytes); K/V read grows "
          f"{r['kv_per_1k'] / GB:.4f} GB per 1k positions (fp32 K/V)")
    if args.markdown:
        with args.markdown.open("a") as f:
            f.write(md.splitlines()[-1] + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
