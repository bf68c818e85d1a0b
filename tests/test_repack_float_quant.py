"""repack --float-quant: a quantized source's (FP8, AWQ, GGUF) float matrices in turbo's int8, its
tied head read as an int8 copy of the exact table, its quantized matrices byte for byte those of
the plain conversion; greedy decoding and lossless speculation on the result; one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch
from test_repack_formats import WIDE, assert_lossless_speculation

import turbo
from turbo.errors import TurboError
from turbo.load.load_plan import COPY, SEGMENTS, Host, layer_matrices, plan_trunk
from turbo.load.loader import host
from turbo.repack import main as repack_main
from turbo.repack import repack
from turbo.sequence.options import OpenOptions
from turbo.store import quant
from turbo.store.install import HEAD_COPY_KEY, open_install
from turbo.testing import make_checkpoint
from turbo.testing.source_formats import write_fp8, write_int4

CPU = torch.device("cpu")
FULL = Host(None, ("pairs", "int8", "exact", "fp8"))  # a host whose native step reads every format as stored
INT8 = quant.FORMATS["int8"].code  # 5


def _tied_source(tmp, kind):
    src = tmp / f"{kind}-src"
    make_checkpoint(src, 4, **WIDE, tie_word_embeddings=True)
    if kind == "fp8":
        write_fp8(src, reference=False)
    else:
        write_int4(src, kind, group=128, reference=False)
    return src


def _stored(idx, name: str) -> bytes:
    """An install matrix's stored bytes (a quantized one's packed levels, scales and biases)."""
    e = idx.need(name)
    with e.file.open("rb") as f:
        out = b""
        for offset, size in ((e.offset, e.size_bytes), (e.scale_offset, e.scale_size), (e.bias_offset, e.bias_size)):
            f.seek(offset)
            out += f.read(size)
    return out


def assert_float_quant(plain, floats, fmt: str = "int8") -> None:
    """`floats` (--float-quant `fmt`) keeps `plain`'s quantized matrices byte for byte, has its
    float projections in `fmt` and its table exact, and plans the tied head as a `fmt` COPY."""
    a, b = open_install(plain), open_install(floats)
    kept = [n for n, e in a.index.entries.items() if e.bits]
    assert kept and all(b.index.need(n).dtype == a.index.need(n).dtype and _stored(a.index, n) == _stored(b.index, n)
                        for n in kept)
    code = quant.FORMATS[fmt].code
    changed = [n for n, e in b.index.entries.items() if e.dtype == code]
    assert changed and all(not a.index.need(n).bits for n in changed)  # the float ones, now in `fmt`
    table = "trunk.embed_tokens.weight"
    assert b.index.need(table).dtype == a.index.need(table).dtype and _stored(a.index, table) == _stored(b.index, table)
    p, q = (plan_trunk(i.index.entries, i.arch, OpenOptions(), CPU, FULL) for i in (a, b))
    assert (q.embed.head.form, q.embed.head.bits, q.embed.rows_of_head) == (COPY, quant.FORMATS[fmt].bits, False)
    assert p.embed.head.form != COPY and q.embed.table == q.storage
    assert any(m.form == SEGMENTS for layer in q.layers for m in layer_matrices(layer))  # layers mix formats
    here = plan_trunk(b.index.entries, b.arch, OpenOptions(), CPU, host(OpenOptions(), CPU), b.index.packed)
    assert here.embed.head.form != COPY or not b.index.packed or here.embed.head.mapped  # the open layout's copy


@pytest.mark.parametrize("kind", ["fp8", "awq"])
def test_float_matrices_and_the_tied_head_go_to_int8(kind, tmp_path, capsys):
    src = _tied_source(tmp_path, kind)
    repack(src, tmp_path / "plain", quiet=True)
    capsys.readouterr()
    assert repack_main([str(src), str(tmp_path / "fq"), "--float-quant", "int8"]) == 0
    assert capsys.readouterr().err.splitlines()[0].endswith("the float matrices (and the tied head's copy) as int8")
    assert_float_quant(tmp_path / "plain", tmp_path / "fq")
    assert "quantization_config" not in json.loads((tmp_path / "fq" / "config.json").read_text())
    assert_lossless_speculation(turbo.open(tmp_path / "fq", backend="cpu"), mtp=False)
    if kind == "awq":  # int4: the same, in turbo's int4
        repack(src, tmp_path / "fq4", quiet=True, float_quant="int4")
        assert_float_quant(tmp_path / "plain", tmp_path / "fq4", "int4")


def _set_metadata(path, key: str, value: str) -> None:
    """Rewrite one __metadata__ entry of a safetensors file (offsets are relative to the data)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"][key] = value
    new = json.dumps(header).encode()
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def test_a_malformed_recorded_head_is_refused(tmp_path):
    src = _tied_source(tmp_path, "awq")
    repack(src, tmp_path / "fq", quiet=True, float_quant="int8")
    weights = tmp_path / "fq" / "model.safetensors"
    for value, match in [("[8]", "is not a JSON object"), ('{"trunk.embed_tokens.weight": "int3"}', "does not name"),
                         ('{"trunk.layers.0.mlp.up_proj.weight": "int8"}', "does not name")]:
        _set_metadata(weights, HEAD_COPY_KEY, value)
        with pytest.raises(TurboError, match=match):
            open_install(tmp_path / "fq").index


def test_gguf_keeps_its_q8_0_codes(tmp_path):
    pytest.importorskip("gguf")
    from test_repack_gguf import SHAPE

    from turbo.testing.gguf_writer import write_gguf

    make_checkpoint(tmp_path / "hf", 3, tie_word_embeddings=True, **SHAPE)
    # llama-quantize --token-embedding-type bf16: a float table; one float projection beside the Q8_0 ones
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "Q8_0", mtp="none",
                      types={"token_embd.weight": "BF16", "blk.0.ffn_up.weight": "F16"})
    repack(path, tmp_path / "plain", quiet=True)
    repack(path, tmp_path / "fq", quiet=True, float_quant="int8")
    assert_float_quant(tmp_path / "plain", tmp_path / "fq")
    idx = open_install(tmp_path / "fq").index
    assert idx.need("trunk.layers.0.mlp.up_proj.weight").dtype == INT8
    assert {e.dtype for e in idx.entries.values() if e.bits} == {INT8, 25}  # int8, Q8_0's int8g32
    out = turbo.open(tmp_path / "fq", backend="cpu").generate("def f(x):", max_new_tokens=8, policy="off")
    assert len(out.tokens) == 8


def _refused(capsys, argv, match: str, out) -> None:
    capsys.readouterr()
    assert repack_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err
    assert not out.exists() and not any(p.name.startswith(f".{out.name}") for p in out.parent.iterdir())


def test_refusals_are_one_line(tmp_path, capsys):
    plain = tmp_path / "bf16"
    make_checkpoint(plain, 0)
    out = tmp_path / "out"
    _refused(capsys, [str(plain), str(out), "--float-quant", "int8"], "is a float checkpoint (use --quant int8)", out)
    src = _tied_source(tmp_path, "awq")
    _refused(capsys, [str(src), str(out), "--float-quant", "int8", "--quant", "int4"],
             "--float-quant int8 with --quant int4", out)
    with pytest.raises(SystemExit) as e:
        repack_main([str(src), str(out), "--float-quant", "int2"])
    assert e.value.code == 2 and "invalid choice: 'int2'" in capsys.readouterr().err
    assert not out.exists()
    pytest.importorskip("gguf")
    from turbo.testing.gguf_writer import write_gguf
    path = write_gguf(plain, tmp_path / "f32.gguf", "F32", mtp="none")
    _refused(capsys, [str(path), str(out), "--float-quant", "int4"], "holds only float tensors (use --quant int4)", out)
