"""A llama.cpp GGUF (qwen35 / qwen35moe, with its MTP head in it or in a separate GGUF) into a
turbo install: config.json, tokenizer.json, the chat template and generation eos ids rebuilt
from the metadata (`gguf_config`, repack_gguf_vocab.py), every tensor mapped back to the HF name
and layout llama.cpp's converter took it from (`GgufSource.plan`), converted by
repack_gguf_tensors.py. Read with the `gguf` package; docs/formats.md, "GGUF".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import TurboError
from ..extras import missing
from ..load.open_layout import write_layout_of
from ..store import quant as q
from ..store.arch import arch_from_config
from ..store.install import DRAFTER_DIR
from ..store.safetensors_format import write_safetensors
from .gguf_check import check_planned, check_table, expected_shapes
from .gguf_tensors import EXACT_TYPES, FLOAT_TYPES, Inverse, Requant, plan_gguf
from .gguf_vocab import write_tokenizer
from .source import check_links, plan_drafter
from .tensors import Planned
from .write import building, copy_file, head_copy

ARCHES = {"qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"), "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")}
NORM, HEADS, V_ROWS, QKV, V_COLS, A_LOG, CONV, ROW = range(8)
# GGUF name (after blk.N.) -> HF name (after model.layers.N. or mtp.layers.N.), and the transform
# llama.cpp's converter (conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase) applied
LAYER = {
    "attn_norm.weight": ("input_layernorm.weight", NORM),
    "post_attention_norm.weight": ("post_attention_layernorm.weight", NORM),
    "attn_q.weight": ("self_attn.q_proj.weight", None),  # query and gate interleaved per head, as in HF
    "attn_k.weight": ("self_attn.k_proj.weight", None),
    "attn_v.weight": ("self_attn.v_proj.weight", None),
    "attn_output.weight": ("self_attn.o_proj.weight", None),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", NORM),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", NORM),
    "attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", QKV),
    "attn_gate.weight": ("linear_attn.in_proj_z.weight", V_ROWS),
    "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", HEADS),
    "ssm_beta.weight": ("linear_attn.in_proj_b.weight", HEADS),
    "ssm_a": ("linear_attn.A_log", A_LOG),
    "ssm_dt.bias": ("linear_attn.dt_bias", HEADS),
    "ssm_conv1d.weight": ("linear_attn.conv1d.weight", CONV),
    "ssm_norm.weight": ("linear_attn.norm.weight", None),  # the gated norm: no +1
    "ssm_out.weight": ("linear_attn.out_proj.weight", V_COLS),
    "ffn_gate.weight": ("mlp.gate_proj.weight", None),
    "ffn_up.weight": ("mlp.up_proj.weight", None),
    "ffn_down.weight": ("mlp.down_proj.weight", None),
    "ffn_gate_inp.weight": ("mlp.gate.weight", None),
    "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight", ROW),
    "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", None),
    "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", None),
    "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", None),
}
EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}
NEXTN = {"nextn.eh_proj.weight": ("fc.weight", None), "nextn.enorm.weight": ("pre_fc_norm_embedding.weight", NORM),
         "nextn.hnorm.weight": ("pre_fc_norm_hidden.weight", NORM),
         "nextn.shared_head_norm.weight": ("norm.weight", NORM)}
GLOBAL = {"token_embd.weight": ("trunk.embed_tokens.weight", None), "output_norm.weight": ("trunk.norm.weight", NORM),
          "output.weight": ("trunk.lm_head.weight", None)}


def find_gguf(src: Path) -> Path | None:
    """`src` if it is a .gguf file, the one .gguf in directory `src` (an mtp-*.gguf beside it
    aside), else None."""
    if src.is_file() and src.suffix == ".gguf":
        return src
    if src.is_dir():
        found = sorted(p for p in src.glob("*.gguf") if not p.name.startswith("mtp-"))
        if found and any(src.glob("*.safetensors")):
            raise TurboError(f"{src}: holds both .gguf and .safetensors files (a mixed source); name the .gguf file "
                             f"or a directory of one format")
        if len(found) > 1:
            raise TurboError(f"{src}: holds {len(found)} .gguf files ({', '.join(p.name for p in found[:3])}); "
                             f"name the one to repack")
        return found[0] if found else None
    return None


def _open(path: Path):
    try:
        import gguf
    except ImportError:
        raise TurboError(missing("gguf", "gguf")) from None
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError, EOFError) as e:
        why = "a tensor's data runs past the end of the file (truncated?)" if "reshape" in str(e) else str(e)[:160]
        raise TurboError(f"{path}: not a GGUF turbo can read: {why}") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise TurboError(f"{path}: tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, past the end of the "
                             f"file ({size} bytes): truncated")
    check_table(path, reader, size)  # (gguf_check.py: alignment, overlaps, zero dims)
    return reader


class GgufSource:
    """One GGUF file's metadata and tensors."""

    def __init__(self, path: Path):
        self.path = path
        self.reader = _open(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.shapes: dict[str, list[int]] = {}  # each planned install tensor's logical shape (checked against the config)
        self.expected: dict[str, tuple[int, ...]] = {}  # the shapes the config implies (gguf_check.py)
        self.arch = self.value("general.architecture")
        if self.arch not in ARCHES:
            raise TurboError(f"{path}: general.architecture is {self.arch!r}, expected one of {', '.join(ARCHES)} "
                             f"(Qwen3.5 dense or MoE)")

    def value(self, key: str, required: bool = True):
        f = self.reader.fields.get(key.format(arch=getattr(self, "arch", "")))
        if f is None:
            if required:
                raise TurboError(f"{self.path}: metadata key {key.format(arch=getattr(self, 'arch', ''))} is missing "
                                 f"(the checkpoint's config needs it)")
            return None
        return f.contents()

    def config(self) -> dict:
        """config.json from the metadata; a value the checkpoint must carry is never defaulted."""
        v = lambda k, required=True: self.value("{arch}." + k, required)  # noqa: E731
        model_type, architecture = ARCHES[self.arch]
        mtp = v("nextn_predict_layers", False) or 0
        layers = v("block_count") - mtp
        head_dim = v("attention.key_length")
        v_heads = v("ssm.time_step_rank")
        recurrent = v("attention.recurrent_layers", False)
        if recurrent is not None:
            kinds = ["linear_attention" if r else "full_attention" for r in recurrent[:layers]]
        else:
            every = v("full_attention_interval")
            kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise TurboError(f"{self.path}: no token_embd.weight tensor (the embedding table)")
        scaling = v("rope.scaling.type", False)
        if scaling not in (None, "none"):
            raise TurboError(f"{self.path}: rope.scaling.type {scaling!r}: turbo rebuilds only unscaled RoPE from GGUF")
        cfg = {"architectures": [architecture], "model_type": model_type,
               "vocab_size": int(embd.shape[1]), "hidden_size": v("embedding_length"), "num_hidden_layers": layers,
               "layer_types": kinds, "num_attention_heads": v("attention.head_count"),
               "num_key_value_heads": v("attention.head_count_kv"), "head_dim": head_dim,
               "rms_norm_eps": v("attention.layer_norm_rms_epsilon"), "max_position_embeddings": v("context_length"),
               "rope_parameters": {"rope_type": "default", "rope_theta": v("rope.freq_base"),
                                   "partial_rotary_factor": v("rope.dimension_count") / head_dim},
               "linear_conv_kernel_dim": v("ssm.conv_kernel"), "linear_key_head_dim": v("ssm.state_size"),
               "linear_num_key_heads": v("ssm.group_count"), "linear_num_value_heads": v_heads,
               "linear_value_head_dim": v("ssm.inner_size") // v_heads,
               "tie_word_embeddings": "output.weight" not in self.tensors, "hidden_act": "silu"}
        if self.arch == "qwen35moe":
            cfg |= {"num_experts": v("expert_count"), "num_experts_per_tok": v("expert_used_count"),
                    "moe_intermediate_size": v("expert_feed_forward_length"),
                    "shared_expert_intermediate_size": v("expert_shared_feed_forward_length")}
        else:
            cfg["intermediate_size"] = v("feed_forward_length")
        eos = self.value("tokenizer.ggml.eos_token_id", False)
        if eos is not None:
            cfg["eos_token_id"] = int(eos)
        if mtp:
            cfg["mtp_num_hidden_layers"] = mtp
        return cfg

    def types(self) -> dict[str, int]:
        """How many tensors of each ggml type."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return out

    def plan(self, cfg: dict, requant: Requant, quantized: dict[str, dict], layers: range) -> list[Planned]:
        """The install tensors of blocks `layers` (blocks past the trunk's are the MTP head's) and,
        with the trunk's blocks, the embedding, the final norm and the head."""
        trunk = layers.start == 0
        n_trunk = cfg["num_hidden_layers"]
        planned = []
        for name, t in self.tensors.items():
            if not name.startswith("blk."):
                if name not in GLOBAL:
                    raise TurboError(f"{self.path}: unexpected tensor {name} (not one llama.cpp writes for {self.arch})")
                if trunk:
                    new, kind = GLOBAL[name]
                    planned += self._one(new, t, kind, cfg, requant, quantized)
                continue
            if name.count(".") < 2:
                raise TurboError(f"{self.path}: unexpected tensor {name} (not one llama.cpp writes for {self.arch})")
            _, block, rest = name.split(".", 2)
            if not block.isdecimal() or int(block) not in layers:
                if not block.isdecimal():
                    raise TurboError(f"{self.path}: unexpected tensor {name}")
                if int(block) >= self.value("{arch}.block_count"):  # (skipped, it would drop a block unsaid)
                    raise TurboError(f"{self.path}: tensor {name} of block {block}, past the metadata's "
                                     f"{self.arch}.block_count {self.value('{arch}.block_count')}")
                continue
            i = int(block)
            stem = f"trunk.layers.{i}." if i < n_trunk else f"mtp.layers.{i - n_trunk}."
            if rest in NEXTN and i >= n_trunk:
                new, kind = NEXTN[rest]
                planned += self._one("mtp." + new, t, kind, cfg, requant, quantized)
            elif rest in EXPERTS:
                planned += self._experts(stem, EXPERTS[rest], t, cfg, requant, quantized)
            elif rest in LAYER:
                new, kind = LAYER[rest]
                planned += self._one(stem + new, t, kind, cfg, requant, quantized)
            else:
                raise TurboError(f"{self.path}: unexpected tensor {name} (not one llama.cpp writes for {self.arch})")
        return planned

    def _experts(self, stem: str, proj: str, t, cfg: dict, requant: Requant, quantized: dict) -> list[Planned]:
        shape = [int(n) for n in reversed(t.shape.tolist())]
        if len(shape) != 3 or shape[0] != cfg.get("num_experts"):
            raise TurboError(f"{self.path}: {t.name} has shape {shape}, expected a stack of num_experts "
                             f"{cfg.get('num_experts')} matrices")
        per = shape[1]
        for e in range(shape[0]):
            self._shape(f"{stem}mlp.experts.{e}.{proj}.weight", shape[1:], t.name)
        return [p for e in range(shape[0])
                for p in plan_gguf(f"{stem}mlp.experts.{e}.{proj}.weight", t, shape[1:], Inverse(), requant, quantized,
                                   slice(e * per, (e + 1) * per))]

    def _one(self, new: str, t, kind: int | None, cfg: dict, requant: Requant, quantized: dict) -> list[Planned]:
        shape = [int(n) for n in reversed(t.shape.tolist())]
        # the install's shape, checked before the inverse reorders heads by it
        self._shape(new, [shape[0], 1, shape[1]] if kind == CONV and len(shape) == 2 else [1, shape[-1]]
                    if kind == ROW else shape, t.name)
        inverse = _inverse(kind, shape, cfg)
        return plan_gguf(new, t, inverse.shape or shape, inverse, requant, quantized)

    def _shape(self, new: str, shape: list[int], gguf_name: str) -> None:
        """Record install tensor `new`'s shape, refused unless the config implies it."""
        want = self.expected.get(new)
        if want is not None and tuple(shape) != want:
            raise TurboError(f"{self.path}: {gguf_name} has shape {shape[::-1]} (GGUF order; {shape} as {new}), "
                             f"expected {list(want)} from the metadata's config")
        self.shapes[new] = shape


def _tiled_to_grouped(n: int, k_heads: int, unit: int) -> torch.Tensor:
    """Indices that undo the converter's V-head reorder of `n` rows (units of `unit`): GGUF
    holds them tiled [per-key-head copy, key head, unit], HF grouped [key head, copy, unit]."""
    return torch.arange(n).reshape(n // (k_heads * unit), k_heads, unit).transpose(0, 1).reshape(n)


def _inverse(kind: int | None, shape: list[int], cfg: dict) -> Inverse:
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    reorder = nk != nv  # the converter reorders V heads only then
    if kind == NORM:
        return Inverse(elementwise=lambda w: w - 1.0)  # exact: w + 1 was computed in fp32 from a bf16 w
    if kind == A_LOG:
        return Inverse(row_idx=_tiled_to_grouped(nv, nk, 1) if reorder else None, elementwise=a_log_from_ssm_a)
    if kind == CONV:  # [C, K] -> [C, 1, K]; the V channels after q and k reordered
        qk = 2 * nk * dk
        idx = torch.cat([torch.arange(qk), qk + _tiled_to_grouped(shape[0] - qk, nk, dv)]) if reorder else None
        return Inverse(row_idx=idx, shape=[shape[0], 1, shape[1]])
    if kind == ROW:
        return Inverse(shape=[1, shape[-1]])
    if not reorder or kind is None:
        return Inverse()
    if kind == QKV:
        qk = 2 * nk * dk
        return Inverse(row_idx=torch.cat([torch.arange(qk), qk + _tiled_to_grouped(shape[0] - qk, nk, dv)]))
    if kind == V_ROWS:
        return Inverse(row_idx=_tiled_to_grouped(shape[0], nk, dv))
    if kind == HEADS:
        return Inverse(row_idx=_tiled_to_grouped(shape[0], nk, 1))
    return Inverse(col_idx=_tiled_to_grouped(shape[1], nk, dv), col_unit=dv)  # V_COLS


def a_log_from_ssm_a(a: torch.Tensor) -> torch.Tensor:
    """A_log from the converter's ssm_a = -exp(A_log) (fp32): the value whose -exp (in torch's
    fp32, as turbo and transformers compute it) gives back ssm_a bit for bit, a bf16 one first
    (a bf16 checkpoint's own A_log), else the nearest fp32 one."""
    x = torch.log(-a.double())
    best = x.float()
    up, down = torch.nextafter(best, best + 1), torch.nextafter(best, best - 1)
    found = torch.zeros_like(a, dtype=torch.bool)
    for c in (x.to(torch.bfloat16).float(), best, down, up, torch.nextafter(down, down - 1), torch.nextafter(up, up + 1)):
        hit = ~found & (-torch.exp(c) == a)
        best = torch.where(hit, c, best)
        found |= hit
    return best


def repack_gguf(path: Path, out: Path, mtp_path: Path | None = None, quant: str = "none", quiet: bool = False,
                drafter: Path | None = None, text_only: bool = False, floats: q.QFormat | None = None,
                open_layout: bool = True) -> Path:
    """python -m turbo.repack FILE.gguf OUT [--mtp MTP.gguf] [--drafter DIR] [--quant FORMAT]
    [--float-quant FORMAT: `floats`, the float matrices' format] [--no-open-layout]."""
    if out.exists():
        raise TurboError(f"{out}: already exists (expected a new directory to write the install into)")
    if mtp_path is not None and not mtp_path.is_file():
        raise TurboError(f"{mtp_path}: no such MTP GGUF file")
    src = GgufSource(path)
    cfg = src.config()
    arch_from_config(cfg, f"{path} (metadata)")  # refuse what the runtime could not open
    n_trunk = cfg["num_hidden_layers"]
    sources = [(src, range(0, n_trunk + cfg.get("mtp_num_hidden_layers", 0)))]
    if mtp_path is not None:
        head = GgufSource(mtp_path)
        head_cfg = head.config()
        if head.arch != src.arch or head_cfg["num_hidden_layers"] != n_trunk or not head_cfg.get("mtp_num_hidden_layers"):
            raise TurboError(f"{mtp_path}: not an MTP head for {path.name} (expected {src.arch} with "
                             f"{n_trunk} trunk blocks and nextn_predict_layers > 0)")
        sources = [(src, range(0, n_trunk)), (head, range(n_trunk, n_trunk + head_cfg["mtp_num_hidden_layers"]))]
        cfg["mtp_num_hidden_layers"] = head_cfg["mtp_num_hidden_layers"]
    elif "mtp_num_hidden_layers" in cfg and not any(
            n.startswith(f"blk.{n_trunk}.nextn.") for n in src.tensors):
        del cfg["mtp_num_hidden_layers"]
    types = {k: n for s, _ in sources for k, n in s.types().items()}
    if quant not in ("none", *q.FORMATS):
        raise TurboError(f"--quant {quant!r} is not one of none, {', '.join(q.FORMATS)}")
    requant = Requant(q.FORMATS.get(quant), floats)
    if floats is not None and not set(types) - set(FLOAT_TYPES):
        raise TurboError(f"--float-quant: {path} holds only float tensors (use --quant {floats.name})")
    other = sorted(k for k in types if k not in EXACT_TYPES and k not in FLOAT_TYPES)
    if other and requant.fmt is None:
        raise TurboError(f"{path}: holds {', '.join(other)} tensors, which turbo's formats do not carry exactly: name "
                         f"the format to re-quantize them to (--quant {' | '.join(q.FORMATS)})")
    quantized: dict[str, dict] = {}
    expected = expected_shapes(arch_from_config(cfg, f"{path} (metadata)"), cfg.get("mtp_num_hidden_layers", 0))
    for s, _ in sources:
        s.expected = expected
    planned = [p for s, layers in sources for p in s.plan(cfg, requant, quantized, layers)]
    check_planned(str(path), {k: v for s, _ in sources for k, v in s.shapes.items()}, expected)
    drafter_quant: dict[str, dict] = {}
    if drafter is not None:  # a DFlash drafter (HF layout) rides along, as with any source
        if not drafter.is_dir():
            raise TurboError(f"{drafter}: no such drafter directory")
        check_links(drafter)
    drafter_plan = plan_drafter(drafter, cfg["hidden_size"], requant.fmt or floats, drafter_quant) if drafter else []
    if not quiet:
        print(f"{path.name}: GGUF {src.arch}, {', '.join(f'{n} {k}' for k, n in sorted(types.items()))} -> install "
              f"({'Q8_0/Q4_x as int8g32/int4g32 exactly' if set(types) & set(EXACT_TYPES) else 'floats as they are'}"
              f"{f', {other} re-quantized to {quant}' if other else ''}"
              f"{f', float matrices (and the tied head copy) as {floats.name}' if floats else ''})", file=sys.stderr)
    with building(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        write_tokenizer(src, tmp)
        with tqdm(total=sum(p.size for p in planned + drafter_plan), unit="B", unit_scale=True,
                  desc=f"repack {path.name}", disable=quiet, file=sys.stderr) as bar:
            write_safetensors(tmp / "model.safetensors", planned, bar, quantized,
                              head_copy(planned, quantized, bool(cfg.get("tie_word_embeddings")), floats))
            if drafter_plan:
                (tmp / DRAFTER_DIR).mkdir()
                copy_file(drafter / "config.json", tmp / DRAFTER_DIR / "config.json")
                write_safetensors(tmp / DRAFTER_DIR / "model.safetensors", drafter_plan, bar, drafter_quant)
        write_layout_of(tmp, open_layout)  # (turbo/load/open_layout.py: opens map the native step's matrices)
    for kind, err in sorted(requant.worst.items()):
        print(f"{kind} -> {quant}: max abs error {err:.3g} against gguf's dequantization", file=sys.stderr)
    return out
