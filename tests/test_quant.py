"""Quantized installs (docs/DESIGN.md 4): formats, repack --quant, the resident index, MLX-layout
sources, the CPU forward, lossless speculation, and malformed tensors refused by name."""

import json
import tracemalloc

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from turbo import engine
from turbo.errors import TurboError
from turbo.load.loader import load_trunk
from turbo.repack import repack
from turbo.sequence.options import OpenOptions
from turbo.store import quant
from turbo.store.install import ResidentIndex, open_install
from turbo.testing import hf_config, make_checkpoint, make_drafter


def Trunk(inst, **opts):  # noqa: N802
    return load_trunk(inst, OpenOptions(**opts), "cpu")

FMT = quant.FORMATS
# every projection's input width divides 128 (and 64): all of them quantize in all formats
WIDE = dict(hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=32)


def _bound(w: torch.Tensor, fmt: quant.QFormat) -> torch.Tensor:
    """Per element: half a step, plus what rounding scale and bias to their storage dtype
    can add at the clamped ends, plus fp32 slack."""
    eps = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[fmt.scale_dtype]
    g = w.float().reshape(w.shape[0], -1, fmt.group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = (hi - lo) / ((1 << fmt.bits) - 1)
    b = 0.5 * step * (1 + eps) + ((1 << fmt.bits) - 1) * step * eps + lo.abs() * eps + 1e-6 * (hi.abs() + lo.abs())
    return b.expand_as(g).reshape(w.shape)


@pytest.mark.parametrize("fmt", ["int4", "int2", "int1"])  # int8: tests/test_trunk_products.py
def test_quantize_dequantize_error_bounds(fmt):
    f = FMT[fmt]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 512, generator=g) * 0.05
    w[3, :128] = 0.25  # a constant group: scale 0, exact
    w[5] *= 40.0  # a row with a wide range
    packed, scales, biases = quant.quantize(w, f)
    assert packed.dtype == torch.int32 and packed.shape == (48, 512 * f.bits // 32)
    assert scales.shape == biases.shape == (48, 512 // f.group) and scales.dtype == f.scale_dtype
    back = quant.dequantize(packed, scales, biases, f.bits, f.group)
    err = (back - w).abs()
    assert torch.all(err <= _bound(w, f)), f"{fmt}: max excess {(err - _bound(w, f)).max():.3g}"
    assert torch.equal(back[3, :128], w[3, :128])
    # levels: unpack(pack(q)) is the identity, and every level is in range
    levels = quant.unpack(packed, f.bits)
    assert int(levels.max()) <= (1 << f.bits) - 1
    assert torch.equal(quant.pack(levels, f.bits), packed)
    # the typical error of a Gaussian matrix is about step/sqrt(12) (uniform rounding)
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < {"int4": 0.15, "int2": 0.7, "int1": 2.5}[fmt]


@pytest.mark.parametrize("bits", [8, 4, 2, 1])
def test_pack_is_the_mlx_little_endian_layout(bits):
    """Field j of a word at bits j * bits, whichever way pack and unpack get there (8 and 4 bits:
    the words' own bytes)."""
    per = 32 // bits
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 1 << bits, (3, 4 * per), generator=g)
    packed = quant.pack(q, bits)
    for r in range(3):
        for j in range(4 * per):
            word = int(packed[r, j // per]) & 0xFFFFFFFF
            assert (word >> ((j % per) * bits)) & ((1 << bits) - 1) == int(q[r, j])
    assert torch.equal(quant.unpack(packed, bits), q.to(torch.uint8))
    assert torch.equal(quant.pack(q.to(torch.uint8), bits), packed)  # (uint8 levels, as a GGUF's)


def _quant_install(tmp, fmt="int4", seed=0, drafter=True, **over):
    src = tmp / f"hf{seed}"
    model = make_checkpoint(src, seed, **over)
    d = None
    if drafter:
        cfg = hf_config(**over)
        d = make_drafter(tmp / f"drafter{seed}", cfg.hidden_size, cfg.vocab_size, [0, cfg.num_hidden_layers - 2],
                         seed=seed, intermediate=cfg.intermediate_size)
    return model, src, repack(src, tmp / f"install-{fmt}", drafter=d, quiet=True, quant=fmt)


@pytest.fixture(scope="module")
def int4_install(tmp_path_factory):
    return _quant_install(tmp_path_factory.mktemp("q4"), "int4", intermediate_size=128)


def test_repack_int4_index_reports_code_offsets_and_logical_shape(int4_install):
    model, src, out = int4_install
    inst = open_install(out)
    idx = inst.index
    e = idx.need("trunk.layers.0.mlp.gate_proj.weight")
    assert (e.dtype, e.shape, e.dims, e.bits, e.group) == (4, (128, 64, 0, 0), (128, 64), 4, 64)
    assert e.st_dtype == "U32" and e.packed_dims == (128, 8) and e.size_bytes == 128 * 64 // 2
    sc, bi = idx.need(e.name + ".scales"), idx.need(e.name + ".biases")
    assert (e.scale_offset, e.scale_size, e.bias_offset, e.bias_size) == (sc.offset, sc.size_bytes, bi.offset,
                                                                       bi.size_bytes)
    assert e.scale_size == 128 * 1 * 2 and sc.st_dtype == "BF16"
    for name in ("trunk.lm_head.weight", "trunk.layers.0.linear_attn.in_proj_qkv.weight",
                 "trunk.layers.0.linear_attn.in_proj_b.weight", "trunk.layers.3.self_attn.q_proj.weight",
                 "trunk.layers.3.self_attn.o_proj.weight", "trunk.layers.1.mlp.down_proj.weight",
                 "dflash.fc.weight", "dflash.layers.0.self_attn.q_proj.weight", "dflash.layers.4.mlp.down_proj.weight"):
        assert idx.need(name).dtype == 4, name
    # float stays float: embeddings, norms, conv kernels, A_log, dt_bias, drafter conv/selector
    for name in ("trunk.embed_tokens.weight", "trunk.norm.weight", "trunk.layers.0.linear_attn.conv1d.weight",
                 "trunk.layers.0.linear_attn.A_log", "trunk.layers.0.linear_attn.dt_bias",
                 "trunk.layers.0.linear_attn.norm.weight", "dflash.layers.0.attention_conv.kernel_projection.weight",
                 "dflash.layers.0.attention_conv.base_kernel", "dflash.candidate_selector.predecessor_codebook",
                 "dflash.candidate_selector.hidden_projection.weight"):
        assert idx.need(name).dtype == 3, name
    # the metadata names exactly the quantized tensors
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()[quant.METADATA_KEY])
    assert meta["trunk.lm_head.weight"] == {"code": 4, "group": 64, "bits": 4}
    assert all(idx.need(n).dtype == 4 for n in meta)
    # load() dequantizes: the original within the int4 bound
    w = model.model.layers[0].mlp.gate_proj.weight.detach()
    assert torch.all((idx.load(e.name) - w).abs() <= _bound(w, FMT["int4"]))
    assert idx.load_quantized(e.name).shape == (128, 64)


def test_quantizing_repack_holds_one_tensor_at_a_time(tmp_path):
    src = tmp_path / "hf"
    make_checkpoint(src, 0)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for i in range(3):  # 12 MB together, 4 MB each
        tensors[f"mtp.layers.{i}.mlp.up_proj.weight"] = torch.randn(512, 2048)
    save_file(tensors, str(src / "model.safetensors"))
    largest = 512 * 2048 * 4
    tracemalloc.start()
    out = repack(src, tmp_path / "inst", quiet=True, quant="int4")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1.5 * largest + 2 * 1024 * 1024, peak
    assert ResidentIndex([out / "model.safetensors"]).need("mtp.layers.2.mlp.up_proj.weight").dtype == 4


def test_quantized_install_is_smaller_on_disk(int4_install, tmp_path):
    _, src, out = int4_install
    plain = repack(src, tmp_path / "plain", quiet=True)
    assert (out / "model.safetensors").stat().st_size < 0.5 * (plain / "model.safetensors").stat().st_size


@pytest.mark.parametrize("fmt", ["int4", "int2", "int1"])
def test_speculation_on_a_quantized_install_is_lossless(fmt, int4_install, tmp_path):
    if fmt == "int4":
        out = int4_install[2]
    else:  # groups of 128 need 128-wide inputs
        out = _quant_install(tmp_path, fmt, seed=1, num_hidden_layers=4, **WIDE)[2]
    rt = engine.open(str(out), backend="cpu")
    assert rt.install.index.need("trunk.layers.3.self_attn.q_proj.weight").dtype == FMT[fmt].code
    prompt = "def f(x):\n    return x"
    plain = rt.generate(prompt, max_new_tokens=24, policy="off", stop_at_eos=False)
    for block, rollback in ((2, "checkpoint"), (4, "replay")):
        spec = rt.generate(prompt, max_new_tokens=24, policy="fixed", block=block, rollback=rollback,
                           stop_at_eos=False)
        assert spec.stats.drafted > 0 and spec.stats.speculation_off_reason is None
        assert spec.tokens == plain.tokens, (fmt, block, rollback)


def test_packed_weights_compute_the_same_as_dequantized_at_load(int4_install):
    inst = open_install(int4_install[2])
    at_load = Trunk(inst, native=False)  # both on the torch step: packed matrices never take native.c
    packed = Trunk(inst, native=False, quant_cpu="packed")
    assert isinstance(packed.layers[0].gate_up, quant.QuantizedWeight)
    assert isinstance(packed.layers[0].mixer.in_proj, quant.QuantizedWeight)  # fused packed: qkv|z|b|a
    assert torch.equal(packed.layers[0].gate_up.dequantize(), at_load.layers[0].gate_up)
    tokens = [5, 17, 99, 3, 42, 7]
    outs = []
    for t in (at_load, packed):
        st = t.new_state()
        t.prefill(st, tokens[:3])
        outs.append(t.step(st, tokens[3:]).logits)
    assert torch.equal(outs[0], outs[1])
    # a verify row equals the decode step it stands for, bit for bit, on packed weights
    st1, st2 = packed.new_state(), packed.new_state()
    packed.prefill(st1, tokens[:3])
    packed.prefill(st2, tokens[:3])
    rows = packed.step(st1, tokens[3:]).logits
    singles = torch.cat([packed.step(st2, [t]).logits for t in tokens[3:]])
    assert torch.equal(rows, singles)


def test_int4_kernel_mode_is_lossless_and_row_stable(int4_install, monkeypatch):
    """The integer path (TURBO_QUANT_CPU=kernel, bf16 activations): verify rows equal decode steps."""
    monkeypatch.setenv(quant.CPU_MODE_ENV, "kernel")
    rt = engine.open(str(int4_install[2]), backend="cpu", dtype="bfloat16")
    gu = rt.trunk.layers[0].gate_up
    assert isinstance(gu, quant.QuantizedWeight) and gu.use_kernel and gu.kernel() is not None
    ref = F_linear = torch.nn.functional.linear(torch.ones(1, 64, dtype=torch.bfloat16), gu.dequantize())
    assert torch.allclose(gu.kernel()(torch.ones(1, 64)), F_linear.float(), atol=0.05 * ref.abs().max().item())
    fused = rt.trunk.layers[0].mixer.in_proj  # 104 rows: the kernel wants multiples of 16
    assert fused.use_kernel and fused.kernel() is None and torch.equal(fused.dense(), fused.dequantize())
    prompt = "def f(x):\n    return x"
    plain = rt.generate(prompt, max_new_tokens=16, policy="off", stop_at_eos=False)
    spec = rt.generate(prompt, max_new_tokens=16, policy="fixed", block=3, stop_at_eos=False)
    assert spec.stats.drafted > 0 and spec.tokens == plain.tokens
    # auto: the kernel on a bf16 trunk, dequantized at load on an fp32 one
    monkeypatch.delenv(quant.CPU_MODE_ENV)
    assert engine.open(str(int4_install[2]), backend="cpu", dtype="bfloat16").trunk.layers[0].gate_up.use_kernel
    at_load = Trunk(open_install(int4_install[2])).layers[0].gate_up  # dequantized: a plain (or packed) matrix
    assert not isinstance(at_load, quant.QuantizedWeight)


def _mlx_checkpoint(tmp, bad=None, embed=False):
    """An HF checkpoint whose projections are stored quantized in the MLX community layout."""
    src = tmp / ("mlx-embed" if embed else "mlx")
    make_checkpoint(src, 2, intermediate_size=128)
    path = src / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for name, t in tensors.items():
        module = name[:-len(".weight")].rsplit(".", 1)[-1] if name.endswith(".weight") else ""
        # MLX quantizes the embedding too (QuantizedEmbedding): it must load dequantized
        if t.dim() == 2 and t.shape[1] % 64 == 0 and (module.endswith("_proj") or module.startswith("in_proj")
                                                      or module == "lm_head" or (embed and module == "embed_tokens")):
            p, s, b = quant.quantize(t, FMT["int4"])
            base = name[:-len(".weight")]
            out[name] = p.view(torch.uint32)
            out[base + ".scales"], out[base + ".biases"] = s, b
        else:
            out[name] = t
    if bad is not None:
        bad(out)
    save_file(out, str(path))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 4}
    (src / "config.json").write_text(json.dumps(cfg))
    return src, tensors


def test_mlx_layout_source_is_carried_packed(tmp_path):
    src, floats = _mlx_checkpoint(tmp_path)
    out = repack(src, tmp_path / "inst", quiet=True)  # --quant none: the packed bytes as they are
    idx = open_install(out).index
    e = idx.need("trunk.layers.0.mlp.up_proj.weight")
    assert (e.dtype, e.dims) == (4, (128, 64))
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        raw = f.get_tensor("model.layers.0.mlp.up_proj.weight")
    assert torch.equal(idx.load_quantized(e.name).packed, raw.view(torch.int32))
    # the same quantization from the float checkpoint: the same numbers
    fsrc = tmp_path / "float"
    make_checkpoint(fsrc, 2, intermediate_size=128)
    ref = open_install(repack(fsrc, tmp_path / "ref", quiet=True, quant="int4"))
    a, b = Trunk(open_install(out)), Trunk(ref)
    sa, sb = a.new_state(), b.new_state()
    assert torch.equal(a.prefill(sa, [1, 2, 3]).logits, b.prefill(sb, [1, 2, 3]).logits)
    with pytest.raises(TurboError, match="requantize"):
        repack(src, tmp_path / "again", quiet=True, quant="int2")
    # MLX quantizes the embedding too: the index reports it, the trunk gathers from it dequantized
    esrc, floats = _mlx_checkpoint(tmp_path, embed=True)
    inst = open_install(repack(esrc, tmp_path / "inst-embed", quiet=True, quant="int4"))
    emb = inst.index.need("trunk.embed_tokens.weight")
    ref_emb = floats["model.embed_tokens.weight"]
    assert emb.dtype == 4 and torch.all((inst.index.load(emb.name) - ref_emb).abs() <= _bound(ref_emb, FMT["int4"]))
    t = Trunk(inst)
    # (kept quantized: each row dequantized as the whole table's dequantization gives it)
    assert torch.equal(t.embed[torch.arange(emb.dims[0])], inst.index.load(emb.name))
    t.prefill(t.new_state(), [1, 2, 3])


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_malformed_mlx_scales_are_refused_by_name(tmp_path):
    def bad(t):
        t["model.layers.1.mlp.down_proj.scales"] = t["model.layers.1.mlp.down_proj.scales"][:, :1].repeat(1, 3)
    src, _ = _mlx_checkpoint(tmp_path, bad)
    with pytest.raises(TurboError) as e:
        repack(src, tmp_path / "inst", quiet=True)
    msg = _one_line(e)
    assert "model.layers.1.mlp.down_proj.weight" in msg and "scales have shape [64, 3], expected [64, 2]" in msg
    assert not (tmp_path / "inst").exists()


def _write(tmp, tensors, table):
    path = tmp / "x.safetensors"
    save_file(tensors, str(path), metadata={quant.METADATA_KEY: json.dumps(table)})
    return [path]


@pytest.mark.parametrize("case, expect", [
    ("scales", "w: scales have shape [8, 2], expected [8, 1]"),
    ("group", "w: group size 64 does not divide its 96 columns"),
    ("bits", "w: 3-bit quantization is not supported"),
    ("code", "w: quantization code 7 is not one of 4, 5, 15, 16"),
    ("dtype", "w.scales: stored as F32, int4 (dtype 4) keeps BF16 scales and biases"),
    ("missing", "w: quantized as int4 but w.scales / w.biases are missing"),
])
def test_malformed_quantized_install_tensors_are_refused_by_name(tmp_path, case, expect):
    words = {"group": 12}.get(case, 8)  # 8 words of int4 = 64 columns
    groups = {"scales": 2}.get(case, 1)
    sdt = torch.float32 if case == "dtype" else torch.bfloat16
    t = {"w": torch.zeros(8, words, dtype=torch.int32).view(torch.uint32),
         "w.scales": torch.ones(8, groups, dtype=sdt), "w.biases": torch.zeros(8, groups, dtype=sdt)}
    if case == "missing":
        del t["w.biases"]
    spec = {"code": 4, "group": 64, "bits": 4}
    if case == "bits":
        spec = {"code": None, "group": 64, "bits": 3}
    if case == "code":
        spec = {"code": 7}
    with pytest.raises(TurboError) as e:
        ResidentIndex(_write(tmp_path, t, {"w": spec}))
    assert expect in _one_line(e)


def test_quantize_refuses_what_it_cannot_group():
    with pytest.raises(TurboError, match="m: group size 128 does not divide its 96 columns"):
        quant.quantize(torch.zeros(4, 96), FMT["int2"], "m")
    with pytest.raises(TurboError, match="m: 8-bit quantization is not supported"):
        quant.format_for(bits=8, group=64, name="m")


def test_cli_quant_flag(tmp_path, capsys):
    from turbo.repack import main

    src = tmp_path / "hf"
    make_checkpoint(src, 0, intermediate_size=128)
    assert main([str(src), str(tmp_path / "q"), "--quant", "int4", "--quiet"]) == 0
    assert open_install(tmp_path / "q").index.need("trunk.layers.0.mlp.down_proj.weight").dtype == 4
    with pytest.raises(SystemExit):
        main([str(src), str(tmp_path / "bad"), "--quant", "int3"])
    src2, _ = _mlx_checkpoint(tmp_path, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.biases",
                                                                 t["model.layers.0.mlp.up_proj.biases"][:5]))
    capsys.readouterr()
    assert main([str(src2), str(tmp_path / "m"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: model.layers.0.mlp.up_proj.weight: biases have shape [5, 1]")


def test_verify_dtype_blocker_reads_the_backend(int4_install):
    from turbo.backends import CPU
    from turbo.sequence.policy import speculation_blocker

    inst = open_install(int4_install[2])
    assert {4, 15, 16} <= set(CPU.verify_dtypes)
    assert speculation_blocker(inst, "dflash", CPU.verify_dtypes) is None
    reason = speculation_blocker(inst, "dflash", (1, 2, 3))
    assert "trunk.layers.3.self_attn.q_proj.weight is dtype 4" in reason
