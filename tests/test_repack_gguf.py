"""GGUF -> install: random Qwen3.5 checkpoints written as llama.cpp GGUFs (gguf's GGUFWriter,
turbo.testing.gguf_writer), repacked; weights against gguf's dequantization, greedy tokens against
transformers and llama.cpp on the dequantized model, lossless speculation, one-line refusals."""

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from test_mtp import mtp_tensors  # noqa: E402

import turbo  # noqa: E402
from turbo.errors import TurboError  # noqa: E402
from turbo.repack import main, repack  # noqa: E402
from turbo.store.install import open_install  # noqa: E402
from turbo.testing import make_checkpoint, make_moe_checkpoint  # noqa: E402
from turbo.testing.gguf_writer import converted, write_gguf  # noqa: E402

# hidden 256: the K-quants' blocks of 256 fit every projection's input
SHAPE = dict(hidden_size=256, intermediate_size=256, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def bf16_valued(directory, extra=None):
    """The checkpoint's weights rounded to bf16 values (stored fp32), as a bf16 checkpoint's are.
    A norm weight below 2^-16 is set to 0: the converter's fp32 w + 1 keeps a bf16 w whole only
    from there up (the GGUF itself has lost a smaller one)."""
    path = directory / "model.safetensors"
    t = {k: v.to(torch.bfloat16).float() for k, v in (load_file(str(path)) | (extra or {})).items()}
    for k, v in t.items():
        if k.endswith("norm.weight") or "norm_" in k:
            v[v.abs() < 2 ** -16] = 0
    save_file(t, str(path), metadata={"format": "pt"})
    return t


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    model = make_checkpoint(tmp / "hf", 0, **SHAPE)
    cfg = model.config
    tensors = bf16_valued(tmp / "hf", mtp_tensors(cfg, 7, scale=0.05))
    return tmp, tensors


def gguf_of(tmp, qtype, **kw):
    path = tmp / f"m-{qtype}-{'-'.join(map(str, kw.values()))}.gguf"
    return path if path.exists() else write_gguf(tmp / "hf", path, qtype, chat_template=TEMPLATE, **kw)


def hf_of(install) -> dict:
    """The install's tensors (dequantized, fp32) under the checkpoint's names."""
    idx = open_install(install).index
    out = {}
    for name, e in idx.entries.items():
        if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] in idx.entries \
                and idx.entries[name.rsplit(".", 1)[0]].bits:
            continue
        hf = "lm_head.weight" if name == "trunk.lm_head.weight" else name.replace("trunk.", "model.", 1)
        out[hf] = idx.load(name).float()
    return out


def check_against_gguf(install, path, n_layers):
    """Every GGUF tensor equals the converter's transforms applied to turbo's weights, bit for
    bit: turbo holds exactly gguf's dequantization mapped back."""
    ours = hf_of(install)
    cfg = json.loads((install / "config.json").read_text())
    reader = gguf.GGUFReader(path)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, n_layers + 1)
    nextn = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
             "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}
    by_gguf = {}
    for hf, t in ours.items():
        hf = f"model.layers.{n_layers}.{nextn[hf]}" if hf in nextn else hf.replace("mtp.layers.0.",
                                                                                    f"model.layers.{n_layers}.")
        hf_conv, t_conv = converted(hf, t, cfg)
        g = hf_conv.replace("model.layers.", "blk.") if ".nextn." in hf_conv else \
            names.get_name(hf_conv, try_suffixes=(".weight", ".bias"))
        by_gguf[g] = t_conv
    assert set(by_gguf) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).copy())
        mine = by_gguf[t.name].reshape(ref.shape)
        # bit for bit but for the sign of zero: Q4_0's d * (q - 8) gives -0.0 where d < 0 and q = 8,
        # turbo's q * s + b gives +0.0
        assert torch.equal(mine.view(torch.int32), (ref + 0.0).view(torch.int32)), t.name


@pytest.mark.parametrize("qtype", ["F32", "BF16", "Q8_0", "Q4_0", "Q4_K"])
def test_exact_types_hold_ggufs_dequantization_bit_for_bit(dense, qtype):
    tmp, tensors = dense
    path = gguf_of(tmp, qtype)
    inst = repack(path, tmp / f"inst-{qtype}", quiet=True)
    check_against_gguf(inst, path, 4)
    codes = {e.dtype for e in open_install(inst).index.entries.values() if e.bits}
    assert codes == {"Q8_0": {25}, "Q4_0": {17}, "Q4_K": {17}}.get(qtype, set())
    if qtype == "F32":  # the checkpoint itself, every tensor (A_log recovered from -exp(A_log))
        ours = hf_of(inst)
        assert set(ours) == set(tensors)
        for name, t in tensors.items():
            assert torch.equal(ours[name].reshape(t.shape), t), name


def test_config_tokenizer_and_template_rebuilt(dense):
    tmp, _ = dense
    inst = repack(gguf_of(tmp, "Q8_0"), tmp / "inst-meta", quiet=True)
    src = json.loads((tmp / "hf" / "config.json").read_text())
    cfg = json.loads((inst / "config.json").read_text())
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads", "head_dim",
              "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim", "intermediate_size", "tie_word_embeddings",
              "max_position_embeddings"):
        assert cfg[k] == src[k], k
    assert cfg["rms_norm_eps"] == pytest.approx(src["rms_norm_eps"]) and cfg["mtp_num_hidden_layers"] == 1
    from tokenizers import Tokenizer
    a, b = Tokenizer.from_file(str(tmp / "hf" / "tokenizer.json")), Tokenizer.from_file(str(inst / "tokenizer.json"))
    for text in ["def f(x):\n    return x + 1", "The quick brown fox <|endoftext|> 12 + 34", " lazy  dog. "]:
        assert a.encode(text).ids == b.encode(text).ids
    assert (inst / "chat_template.jinja").read_text() == TEMPLATE
    assert json.loads((inst / "generation_config.json").read_text())["eos_token_id"] == [0]


def test_other_types_need_quant_and_report_the_agreement(dense, capsys):
    tmp, _ = dense
    path = gguf_of(tmp, "Q6_K")
    with pytest.raises(TurboError, match=r"holds Q6_K tensors.*--quant"):
        repack(path, tmp / "no", quiet=True)
    assert not (tmp / "no").exists()
    inst = repack(path, tmp / "inst-q6", quant="int8", quiet=True)
    err = float(capsys.readouterr().err.split("Q6_K -> int8: max abs error ")[1].split()[0])
    ours = open_install(inst).index
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
    worst = (ours.load("trunk.layers.0.mlp.down_proj.weight") - ref).abs().max().item()
    assert 0 < worst <= err * 1.001 and err < 0.01


def greedy_equal_transformers(install, model_class, config_dir):
    ckpt = install.parent / (install.name + "-hf")
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in hf_of(install).items() if not k.startswith("mtp.")},
              str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    (ckpt / "config.json").write_bytes((config_dir / "config.json").read_bytes())
    model = model_class.from_pretrained(ckpt, dtype=torch.float32).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)[0, 24:].tolist()
    assert turbo.open(install, backend="cpu").generate(prompt[0].tolist(), max_new_tokens=64, policy="off",
                                                       stop_at_eos=False).tokens == ref


def test_greedy_64_tokens_equal_transformers_on_the_dequantized_model(dense):
    from transformers import Qwen3_5ForCausalLM

    tmp, _ = dense
    greedy_equal_transformers(tmp / "inst-Q4_K", Qwen3_5ForCausalLM, tmp / "hf")


def test_moe_q8_0_exact_and_greedy(tmp_path):
    from transformers import Qwen3_5MoeForCausalLM

    make_moe_checkpoint(tmp_path / "hf", **SHAPE | dict(moe_intermediate_size=64, shared_expert_intermediate_size=64))
    bf16_valued(tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "moe.gguf", "Q8_0")
    inst = repack(path, tmp_path / "inst", quiet=True)
    ours, ref = hf_of(inst), load_file(str(tmp_path / "hf" / "model.safetensors"))
    reader = gguf.GGUFReader(path)
    stack = next(t for t in reader.tensors if t.name == "blk.1.ffn_up_exps.weight")
    want = gguf.quants.dequantize(stack.data, stack.tensor_type)[3]
    assert torch.equal(ours["model.layers.1.mlp.experts.3.up_proj.weight"], torch.from_numpy(want.copy()))
    assert torch.equal(ours["model.layers.2.mlp.gate.weight"], ref["model.layers.2.mlp.gate.weight"])
    greedy_equal_transformers(inst, Qwen3_5MoeForCausalLM, tmp_path / "hf")
    from test_native_formats import needs_exact
    from test_trunk_products import assert_rows_are_steps

    from turbo.load.loader import load_trunk
    from turbo.sequence.options import OpenOptions
    needs_exact()  # the native step: the experts read as stored (int8g32 segments), verify rows = decode steps
    trunk = load_trunk(open_install(inst), OpenOptions(), "cpu")
    moe = next(layer.moe for layer in trunk.layers if layer.moe is not None)
    assert trunk.step_name == "native" and {p.layout for p in moe.gate_up[0].parts} == {"exact"}
    assert_rows_are_steps(trunk, [5, 17, 99, 3, 250], list(range(40, 52)))


def test_speculation_lossless_on_a_converted_install(dense):
    tmp, _ = dense
    head = gguf_of(tmp, "Q8_0", mtp="only")
    trunk = gguf_of(tmp, "Q4_0", mtp="none")
    inst = repack(trunk, tmp / "inst-spec", mtp_head=head, quiet=True)
    assert open_install(inst).has_mtp
    rt = turbo.open(inst, backend="cpu")
    prompt = [5, 17, 99, 3, 250, 41, 8, 5, 17, 99]
    ref = rt.generate(prompt, max_new_tokens=24, policy="off", stop_at_eos=False).tokens
    for drafter in ("mtp", "ngram"):
        for rollback in ("checkpoint", "replay"):
            for block in range(1, 9):
                res = rt.generate(prompt, max_new_tokens=24, policy="fixed", block=block, drafter=drafter,
                                  rollback=rollback, stop_at_eos=False)
                assert res.tokens == ref, (drafter, rollback, block)


def _type_field_offset(path, name):
    r = gguf.GGUFReader(path)
    t = next(t for t in r.tensors if t.name == name)
    part = t.field.parts[-2]  # name length, name, n_dims, dims, type, offset
    return part.ctypes.data - r.data.ctypes.data


@pytest.mark.parametrize("damage", ["truncated", "unknown type", "missing key", "unknown arch"])
def test_malformed_ggufs_refused_in_one_line(dense, tmp_path, capsys, monkeypatch, damage):
    src, _ = dense
    path = tmp_path / "bad.gguf"
    if damage == "missing key":
        monkeypatch.setattr(gguf.GGUFWriter, "add_ssm_state_size", lambda self, v: None)
        write_gguf(src / "hf", path, "Q8_0")
    else:
        path.write_bytes(gguf_of(src, "Q8_0").read_bytes())
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[:-1000]
    elif damage == "unknown type":
        at = _type_field_offset(path, "blk.0.ffn_up.weight")
        data[at:at + 4] = (77).to_bytes(4, "little")
    elif damage == "unknown arch":
        at = data.index(b"qwen35")
        data[at:at + 6] = b"qwen99"
    path.write_bytes(bytes(data))
    assert main([str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0]
    assert {"truncated": "truncated", "unknown type": "77", "missing key": "ssm.state_size",
            "unknown arch": "qwen99"}[damage] in err[0]
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_the_native_step_reads_the_exact_types_as_stored(dense, qtype):
    """int8g32 / int4g32 read as stored by the native step's float products (native_exact.py):
    agreeing with the torch step on the same install (test_native_formats.assert_native_agrees),
    verify rows the decode steps bit for bit."""
    from test_native_formats import assert_native_agrees, needs_exact
    from test_trunk_products import assert_rows_are_steps

    needs_exact()
    tmp, _ = dense
    inst = repack(gguf_of(tmp, qtype, mtp="none"), tmp / f"inst-native-{qtype}", quiet=True)
    prompt = [5, 17, 99, 3, 250, 41, 8, 5, 17, 99]
    assert_rows_are_steps(assert_native_agrees(inst, prompt, "exact"), prompt, list(range(40, 52)))


def test_a_tied_head_reads_the_ggufs_own_codes(tmp_path):
    """A tied GGUF's token_embd is carried as stored (Q8_0: int8g32), and the native step's head
    reads those codes (a wtype 7 matrix of one exact segment), not an fp32 copy four times the
    bytes: agreeing with the torch step, verify rows the decode steps bit for bit."""
    from test_native_formats import assert_native_agrees, needs_exact
    from test_trunk_products import assert_rows_are_steps

    needs_exact()
    make_checkpoint(tmp_path / "hf", 3, tie_word_embeddings=True, **SHAPE)
    inst = repack(write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "Q8_0", mtp="none"), tmp_path / "inst", quiet=True)
    assert json.loads((inst / "config.json").read_text())["tie_word_embeddings"] is True
    assert open_install(inst).index.entries["trunk.embed_tokens.weight"].dtype == 25
    prompt = [5, 17, 99, 3, 250, 41, 8, 5, 17, 99]
    nat = assert_native_agrees(inst, prompt, "exact")
    assert nat.lm_head.layout == "segments" and [p.layout for p in nat.lm_head.parts] == ["exact"]
    assert_rows_are_steps(nat, prompt, list(range(40, 52)))


def _llama(path, monkeypatch):
    """llama.cpp (llama_cpp) on the GGUF, every position's logits kept. Its weight repacking (the
    extra buffer types: CPU repack / AMX) is off: in llama-cpp-python 0.3.36 on an AMX host it
    crashes the first decode of a quantized GGUF; the plain path is the same arithmetic."""
    import llama_cpp
    import llama_cpp.llama as lib

    plain = lib.llama_cpp.llama_model_default_params

    def params():
        p = plain()
        p.use_extra_bufts = False
        return p

    monkeypatch.setattr(lib.llama_cpp, "llama_model_default_params", params)
    return llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1, seed=0)


def _turbo_logits(inst, prompt, tokens):
    """turbo's logits after the prompt and after each of `tokens` (decode steps), fp32."""
    trunk = turbo.open(inst, backend="cpu").trunk
    st = trunk.new_state(len(prompt) + len(tokens) + 1)
    rows = [trunk.prefill(st, prompt).logits[-1]] + [trunk.step(st, [t], (), None).logits[-1] for t in tokens]
    return torch.stack(rows).float().numpy()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_llama_cpp_runs_our_ggufs_as_turbo_does(dense, tmp_path, monkeypatch, qtype):
    """llama.cpp opens the writer's GGUF (the token list padded to the vocab, a pre-tokenizer it
    knows). On the GGUF's dequantized weights (the install's, written back as an F32 GGUF) its 24
    greedy tokens are turbo's and its logits agree within 2e-3 of the largest (llama.cpp's own
    float ops). On the quantized GGUF itself llama.cpp rounds the activations to 8 bits in every
    quantized product (Q8_0 / Q8_K dot products) where turbo multiplies the fp32 activations, so
    only closeness holds there (this random model amplifies rounding: a BF16 GGUF, activations
    rounded to bf16, is 4% off): the logits after the prompt within 30% of their largest and the
    top-1 of most steps, teacher-forced on turbo's tokens."""
    pytest.importorskip("llama_cpp")
    tmp, _ = dense
    path = gguf_of(tmp, qtype, mtp="none")
    inst = tmp / f"inst-native-{qtype}"
    if not inst.exists():
        repack(path, inst, quiet=True)
    prompt, n = [5, 17, 99, 3, 250, 41, 8, 5, 17, 99], 24
    mine = turbo.open(inst, backend="cpu").generate(prompt, max_new_tokens=n, policy="off", stop_at_eos=False).tokens
    ours = _turbo_logits(inst, prompt, mine[:-1])

    dequantized = write_gguf(tmp / "hf", tmp_path / "dequantized.gguf", "F32", mtp="none",
                             tensors={k: v for k, v in hf_of(inst).items() if not k.startswith("mtp.")})
    llm = _llama(dequantized, monkeypatch)
    llm.eval(prompt)
    theirs = []
    for _ in range(n):  # llama.cpp's own greedy decode, a token at a time
        theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([theirs[-1]])
    assert theirs == mine
    both = np.array(llm.scores[len(prompt) - 1:len(prompt) + n - 1])
    assert np.abs(both - ours).max() <= 2e-3 * np.abs(ours).max()  # measured: 3e-4 (Q8_0), 5e-4 (Q4_K)

    llm = _llama(path, monkeypatch)
    llm.eval(prompt + mine[:-1])
    quantized = np.array(llm.scores[len(prompt) - 1:len(prompt) + n - 1])
    assert np.abs(quantized[0] - ours[0]).max() <= 0.3 * np.abs(ours[0]).max()  # measured: 12%, 14%
    assert (quantized.argmax(-1) == np.array(mine)).mean() >= 0.7  # measured: 23 / 24, 20 / 24


@pytest.mark.parametrize("n,k", [(37, 128), (300, 512)])
def test_q8_0_products_form_each_weight_with_one_multiply(n, k):
    """A Q8_0 matrix (f16 scale d, bias -128 d) is packed centered (native_exact.centered: levels
    q - 128, each weight c * d, one exact multiply): the products' matrix is gguf's dequantization
    bit for bit (a zero block's included), within fp32 rounding of the dense product, and a verify
    row is the decode step bit for bit; a matrix of other scales keeps the two-rounding form."""
    from test_native_formats import fp32_bound, needs_exact
    from test_trunk_products import ROWS

    from turbo.backends import native_exact, native_pack
    from turbo.repack.gguf_tensors import _affine
    from turbo.store import quant

    needs_exact()
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) / k ** 0.5
    w[3, 32:64] = 0  # a block of d = 0
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    a = _affine(raw, "Q8_0", n, k)
    qw = quant.QuantizedWeight(quant.pack(a.levels, 8), a.scales, a.biases, 8, 32)
    p = native_pack.pack_as(qw, torch.float32, "panels")
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).copy()).reshape(n, k)
    assert native_exact.centered(qw) and p.data[8:12].view(torch.int32).item() == 1
    assert torch.equal(p.dense().view(torch.int32), (ref + 0.0).view(torch.int32))
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(1))
    y = native_pack.linear_packed(x, p)
    assert ((y.double() - x.double() @ ref.double().T).abs() <= fp32_bound(x, ref)).all()
    for rows in ROWS:
        assert torch.equal(native_pack.linear_packed(x[rows - 1:rows], p), y[rows - 1:rows]), rows
    off = quant.QuantizedWeight(qw.packed, qw.scales * 1.001, qw.biases, 8, 32)
    assert not native_exact.centered(off) and native_pack.pack_as(off, torch.float32, "panels").data[8:12].view(
        torch.int32).item() == 0
