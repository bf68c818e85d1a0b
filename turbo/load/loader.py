"""Loading apart from running: an install's tensors read, checked and prepared for a step.

`load_trunk` and `load_drafter` are what the engine calls. Each load is planned first
(turbo/load/load_plan.py: which format every matrix takes, from the index's headers, the arch and
the options), then read as planned (turbo/load/reader.py: `Reader`). Each part gets one step object, chosen
once in the plan (turbo/model/step.py): the native CPU step where `OpenOptions.native`
allows it and it can run, else the torch step; the part keeps the reason (`why_torch`). On
backend cuda (load_trunk's `on_cuda`) the trunk, read on the host as for the CPU, is stepped by
the CUDA step of its own (turbo/backends/cuda_step); the drafters stay on the host. The options
arrive resolved: nothing here reads the environment but TURBO_CUDA_STEP (a test and script switch).
"""

from __future__ import annotations

import os
import sys

import torch

from ..backends import cuda_kernels, native_dflash, native_lib, native_trunk, ops
from ..backends.cuda_step.step import CudaTrunkStep
from ..backends.torch_step import TorchDflashStep, TorchMtpStep, TorchTrunkStep
from ..drafters.dflash import DFLASH_RESIDUAL_SCALE, DflashDrafter, DflashLayer, DflashWeights
from ..drafters.dflash_config import (DflashConfig, DflashShape, derive_published_shape, derive_shape,
    dflash_layer_tensor, parse_drafter_config)
from ..drafters.mtp import MtpDrafter, MtpWeights
from ..errors import TurboError
from ..model.trunk import PREFIX, Trunk, TrunkWeights
from ..sequence.options import OpenOptions
from ..sequence.policy import check_window
from ..store import quant
from ..store.install import Install, ResidentIndex
from ..store.tensor_shapes import MTP_PREFIX
from .load_plan import (DFLASH_BASES, DFLASH_SELECTOR, DRAFT_HEAD, NATIVE_OFF, DrafterPlan, Host, TrunkPlan,
    mtp_tensor_shapes, plan_dflash, plan_mtp, plan_trunk)
from .open_layout import convert_on_open
from .reader import Reader


def _native_refusal(opts: OpenOptions, refusal: str | None) -> str | None:
    """Why a part does not take the native step: the options, the part's own `refusal`,
    or the library's build (built here, once per process, into opts.cache_dir)."""
    if not opts.native:
        return NATIVE_OFF
    if refusal is not None:
        return refusal
    if native_lib.library(opts.cache_dir, opts.compiler) is not None:
        native_lib.set_bf16_products(opts.bf16_products)
    return native_lib.why_not()


def host(opts: OpenOptions, device: torch.device) -> Host:
    """What a plan needs of this machine: the native library built (only for the CPU, where asked)."""
    if device.type != "cpu" or not opts.native:
        return Host()
    why = _native_refusal(opts, None)
    return Host(why, native_lib.dot_layouts() if why is None else ())


def _to(t, device: torch.device):
    """A tensor or a part's weights (dataclasses of them) moved to `device`, once read on the host."""
    return t if device.type == "cpu" else ops.to_device(t, device)


def _norm(index, name: str, device: torch.device) -> torch.Tensor:
    """A drafter's RMSNorm weight as the forward reads it, 1 + w in fp32 (computed on the host,
    as on the CPU, then moved)."""
    return _to(1.0 + index.load(name, torch.float32), device)


# ---- the trunk ------------------------------------------------------------------------------


def load_trunk(install: Install, opts: OpenOptions, device: torch.device | str, on_cuda: bool = False) -> Trunk:
    """The trunk's weights in `opts.dtype` on `device` (prepared on the host exactly as for
    the CPU, then moved there once), on the native step where it can run. Planned first
    (load_plan.plan_trunk: the step, and every matrix's format), then read: the native step's
    matrices are views of the install's open layout, mapped (turbo/store/layout_file.py: nothing read
    at open); a matrix it does not hold is packed as it is read, a slice at a time
    (native_pack.pack_rows), so loading holds about the packed weights and nothing twice."""
    device = torch.device(device)
    quant.cpu_mode(opts.quant_cpu)  # (refused before the library is built)
    here = host(opts, device)
    if here.library is None:  # an older install (none, or a stale open layout) converts itself once
        convert_on_open(install, here)
    trunk = read_trunk(install, plan_trunk(install.index.entries, install.arch, opts, device, here, install.index.packed),
                       device, on_cuda or os.environ.get(CUDA_STEP_ENV) == "1")
    if install.layout_note is not None and here.library is None:  # (once it opened: a refusal stays one line)
        print(install.layout_note, file=sys.stderr)
    return trunk


def read_trunk(install: Install, plan: TrunkPlan, device: torch.device, on_cuda: bool = False) -> Trunk:
    """The trunk as `plan` has it, read on the host and moved to `device` once; `on_cuda`: stepped
    by the CUDA step (its matrices uploaded from the host's as stored)."""
    a = install.arch
    r = Reader(install.index, plan.dtype)
    embed, lm_head = r.embedding(plan.embed)
    final_norm = r.norm(PREFIX + "norm.weight", a.hidden)
    layers = [r.layer(p, a) for p in plan.layers]
    inv_freq = ops.rope_inv_freq(a.rotary_dim, a.rope_theta, a.rope_scaling)
    if device.type != "cpu":  # once, at load: everything above was prepared on the host exactly as for the CPU
        embed = ops.to_device(embed, device)
        lm_head = embed if a.tie_embeddings else ops.to_device(lm_head, device)
        final_norm, inv_freq = ops.to_device(final_norm, device), ops.to_device(inv_freq, device)
        layers = [ops.to_device(layer, device) for layer in layers]
    weights = TrunkWeights(embed, lm_head, final_norm, layers, inv_freq)
    step = TorchTrunkStep if plan.why_torch else native_trunk.NativeTrunkStep
    kv = plan.kv
    if on_cuda and device.type == "cpu":
        # the CUDA step keeps fp32 K/V on the device and mirrors its rows into the state's host
        # caches (what the prefix cache and sessions copy), so those are fp32 too: a copy is exact
        step, kv = cuda_trunk_step, torch.float32
    return Trunk(a, weights, plan.dtype, device, kv, step, plan.why_torch)


# TURBO_CUDA_STEP=1: the CUDA step for a trunk loaded on the host outside backend cuda (tests, scripts);
# backend cuda passes on_cuda. The step runs on CUDA device 0 through the driver API (turbo/backends/
# cuda_step: matrices resident as stored, buffers at open), with TURBO_CUDA_SIM=1 on the simulated device.
CUDA_STEP_ENV = "TURBO_CUDA_STEP"


def cuda_trunk_step(trunk: Trunk) -> CudaTrunkStep:
    return CudaTrunkStep(trunk, cuda_kernels.kernels(0))


# ---- the drafters ---------------------------------------------------------------------------


def load_drafter(kind: str, install: Install, trunk: Trunk, window: int | None, opts: OpenOptions):
    """The install's own drafter of `kind` (dflash | mtp), ready for the engine (turbo.drafters.Drafter)."""
    if kind == "dflash":
        return load_dflash(install, trunk.embed, ops.dense(trunk.lm_head), window, opts, device=trunk.device)
    return load_mtp(install, trunk, opts.draft_products)


def _dflash_shape(install: Install, cfg: DflashConfig, window: int | None) -> DflashShape:
    """The drafter's shape, derived from its tensors and checked against its config and `window`."""
    idx = install.index
    if cfg.has_conv:
        shape = derive_shape(idx, cfg.hidden, cfg.vocab, cfg.taps, cfg.group)
    else:
        shape = derive_published_shape(idx, cfg)
    for key, value, derived in (("num_attention_heads", cfg.heads, shape.num_heads),
                                ("num_key_value_heads", cfg.kv_heads, shape.num_kv_heads),
                                ("head_dim", cfg.head_dim, shape.head_dim),
                                ("intermediate_size", cfg.intermediate, shape.inter)):
        if value != derived:
            raise TurboError(f"dflash/config.json: field {key!r} is {value}, the tensors' is {derived}")
    if shape.aux_count != len(cfg.target_layers):
        raise TurboError(f"dflash.fc.weight fuses {shape.aux_count} aux states, but field 'target_layer_ids' lists "
                         f"{len(cfg.target_layers)}")
    if cfg.has_selector and shape.rank != cfg.rank:
        raise TurboError(f"dflash/config.json: selector_rank is {cfg.rank}, the codebooks have rank {shape.rank}")
    if window is not None:
        check_window(window, cfg.window)
    return shape


def load_dflash(install: Install, embed: torch.Tensor, lm_head: torch.Tensor, window: int | None = None,
                opts: OpenOptions = OpenOptions(), dtype: torch.dtype = torch.float32,
                scale: float = DFLASH_RESIDUAL_SCALE, device: torch.device | str = "cpu") -> DflashDrafter:
    """The install's DFlash drafter (DFlash2 or the published DFlash, as its config names)
    over the trunk's `embed` table and (dense) `lm_head`, in `dtype` activations on `device`;
    `window` its context (None: the trained sliding_window)."""
    if install.drafter_config is None:
        raise TurboError(f"{install.path}: no dflash/config.json (the install carries no DFlash drafter)")
    cfg = parse_drafter_config(install.drafter_config, install.arch, str(install.path / "dflash" / "config.json"))
    shape = _dflash_shape(install, cfg, window)
    idx = install.index
    device = torch.device(device)
    plan = plan_dflash(idx.entries, shape.layers, cfg.has_conv, cfg.has_selector, dtype, opts=opts, device=device,
                       host=host(opts, device), embed=embed, head=lm_head.dtype)
    r = Reader(idx, dtype, given={DRAFT_HEAD: lm_head})
    layers = [_dflash_layer(r, plan, i, cfg.has_conv, device) for i in range(shape.layers)]
    weights = DflashWeights(
        embed=embed, lm_head=r.matrix(plan.head),
        fc=_to(r.matrix(plan.matrices["fc"]), device), hidden_norm=_norm(idx, "dflash.hidden_norm.weight", device),
        final_norm=_norm(idx, "dflash.norm.weight", device),
        hidden_projection=_selector(idx, cfg.has_selector, "hidden_projection.weight", device),
        pred_codebook=_selector(idx, cfg.has_selector, "predecessor_codebook", device),
        succ_codebook=_selector(idx, cfg.has_selector, "successor_codebook", device),
        layers=layers, inv_freq=_to(ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta), device))
    make_step = TorchDflashStep if plan.why_torch else native_dflash.NativeDflashStep
    return DflashDrafter(cfg, shape, weights, window or cfg.window, dtype, scale, device, make_step, plan.why_torch)


def _dflash_layer(r: Reader, plan: DrafterPlan, i: int, conv: bool, device: torch.device) -> DflashLayer:
    """Layer i of a DFlash drafter: its matrices as planned, its norms, its conv's base kernels."""
    def norm(name: str) -> torch.Tensor:
        return _norm(r.index, dflash_layer_tensor(i, name), device)

    def mat(key: str) -> torch.Tensor | None:
        m = plan.matrices.get(f"layers.{i}.{key}")
        return None if m is None else _to(r.matrix(m), device)

    def base(name: str) -> torch.Tensor | None:
        return _to(r.index.load(dflash_layer_tensor(i, name), r.dtype), device) if conv else None

    return DflashLayer(
        in_norm=norm("input_layernorm.weight"), post_norm=norm("post_attention_layernorm.weight"),
        q=mat("q"), k=mat("k"), v=mat("v"), o=mat("o"), q_norm=norm("self_attn.q_norm.weight"),
        k_norm=norm("self_attn.k_norm.weight"), gate=mat("gate"), up=mat("up"), down=mat("down"),
        attn_proj=mat("attn_proj"), attn_base=base(DFLASH_BASES[0]), mlp_proj=mat("mlp_proj"),
        mlp_base=base(DFLASH_BASES[1]),
    )


def _selector(index: ResidentIndex, present: bool, name: str, device: torch.device) -> torch.Tensor | None:
    return _to(index.load(DFLASH_SELECTOR + name, torch.float32), device) if present else None


def load_mtp(install: Install, trunk: Trunk, products: str = "auto") -> MtpDrafter:
    """The install's MTP head over `trunk` (its embedding, lm_head and step: native.c's
    layer on the trunk's native step, with the `products` matrix products)."""
    if not install.has_mtp:
        raise TurboError(f"{install.path}: this install carries no MTP head (mtp.fc.weight is not in the "
                         "resident index)")
    index, arch = install.index, install.arch
    if MTP_PREFIX + "layers.1.input_layernorm.weight" in index:
        raise TurboError("mtp.layers.1.input_layernorm.weight: this head has more than one MTP layer, and this "
                         "port runs exactly one (num_nextn_predict_layers 1, as Qwen3.5 ships)")
    for name, shape in mtp_tensor_shapes(arch).items():
        dims = index.need(name).dims
        if tuple(dims) != shape:
            raise TurboError(f"{name} has shape {list(dims)}, expected {list(shape)} (from the trunk's config)")
    dtype, device = trunk.dtype, trunk.device  # the trunk's: weights moved once at load, the cache there too
    # the head runs on the trunk's step: the library is built where that is the native one
    why = None if trunk.step_name == "native" else trunk.why_torch or f"the trunk runs its {trunk.step_name} step"
    here = Host(None, native_lib.dot_layouts()) if why is None else Host()
    plan = plan_mtp(index.entries, arch, dtype, why, products, here)
    r = Reader(index, dtype)

    def norm(name: str) -> torch.Tensor:
        return _norm(index, MTP_PREFIX + name, device)

    weights = MtpWeights(
        fc=_to(r.matrix(plan.matrices["fc"]), device),
        norm_embedding=norm("pre_fc_norm_embedding.weight"),
        norm_hidden=norm("pre_fc_norm_hidden.weight"),
        final_norm=norm("norm.weight"),
        layer=_to(r.layer(plan.layer, arch), device),
    )
    return MtpDrafter(trunk, weights, TorchMtpStep if plan.why_torch else native_trunk.NativeMtpStep)
