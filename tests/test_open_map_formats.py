"""Open = map for the converted formats (turbo/load/open_layout.py, native_exact.py): an FP8, an int4
(AWQ) and a GGUF Q8_0 install (its tied head read as stored) carry their SEGMENTS matrices in the
open layout, the bytes the loader packs at open, and open by map with no packing, giving the
tokens and logits of the same install packed at open bit for bit; a host without the formats'
products opens such a layout as before (packing what it reads); a layout written before (for a
host without them) is stale, rewritten once at open or by `python -m turbo.load.open_layout`."""

import ctypes
import shutil
from pathlib import Path

import pytest
import torch
from test_native_formats import needs_exact
from test_open_map import PACKING, PROMPT, tokens
from test_repack_formats import _source

import turbo
from turbo.backends import native_exact, native_lib, native_pack
from turbo.load import loader, open_layout
from turbo.load.load_plan import EXACT, PANELS, SEGMENTS, Host, layer_matrices, plan_trunk
from turbo.load.reader import Reader
from turbo.repack import repack
from turbo.sequence.options import OpenOptions
from turbo.store import layout_file, quant
from turbo.store.install import open_install

KINDS = ("fp8", "awq", "gguf-q8_0")
# a GGUF's K-quant-free Q8_0 blocks of 32 fit every input; hidden 256 as tests/test_repack_gguf.py
GGUF_SHAPE = dict(hidden_size=256, intermediate_size=256, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)
NO_FORMATS = Host(None, ("pairs", "int8"))  # a host whose products do not read the formats as stored


def _source_of(kind: str, tmp: Path) -> Path:
    if kind == "gguf-q8_0":
        pytest.importorskip("gguf")
        from turbo.testing import make_checkpoint
        from turbo.testing.gguf_writer import write_gguf
        make_checkpoint(tmp / "hf", 3, tie_word_embeddings=True, **GGUF_SHAPE)
        return write_gguf(tmp / "hf", tmp / "m.gguf", "Q8_0", mtp="none")
    return _source(tmp, kind, **({"group": 128} if kind == "awq" else {}))[1]


@pytest.fixture(scope="module", params=KINDS)
def installs(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(kind, the install repacked now, a copy of it without its layout: packed at open)."""
    needs_exact()
    if request.param == "fp8" and "fp8" not in native_lib.dot_layouts():
        pytest.skip("this CPU has no AVX512-VBMI (the FP8 products)")
    tmp = tmp_path_factory.mktemp(request.param)
    new = repack(_source_of(request.param, tmp), tmp / "new", quiet=True)
    old = tmp / "old"
    shutil.copytree(new, old)
    (old / layout_file.PACKED_FILE).unlink()
    return request.param, new, old


def _plan(install, here: Host | None = None):
    opts = OpenOptions()
    return plan_trunk(install.index.entries, install.arch, opts, torch.device("cpu"),
                      here or loader.host(opts, torch.device("cpu")), install.index.packed)


def _segments(plan) -> list:
    heads = [plan.embed.head] if plan.embed.head is not None else []
    return [m for m in heads + [m for layer in plan.layers for m in layer_matrices(layer)] if m.form == SEGMENTS]


def _logits(rt) -> torch.Tensor:
    return rt.trunk.prefill(rt.trunk.new_state(64), PROMPT, want_logits=True).logits


def test_every_segments_matrix_is_mapped_as_packed_at_open(installs):
    kind, new, old = installs
    new, old = open_install(new), open_install(old)
    assert new.packed and new.layout_note is None
    mapped, packed = _segments(_plan(new)), _segments(_plan(old))
    assert len(mapped) == len(packed) > 0 and all(m.mapped for m in mapped) and not any(m.mapped for m in packed)
    assert any(p.form == EXACT for m in mapped for p in m.parts)
    if kind == "gguf-q8_0":  # the tied head: the table's own Q8_0 codes, one exact segment
        assert _plan(new).embed.head.mapped and _plan(new).embed.head.form == SEGMENTS
    elif _plan(new).embed.head is not None:  # the float head, in the layers' storage (not fp32 for want of the products)
        assert _plan(new).embed.head.mapped
    rn, ro = Reader(new.index, torch.float32), Reader(old.index, torch.float32)
    for m, p in zip(mapped, packed):
        a, b = rn.matrix(m), ro.matrix(p)
        assert (a.layout, a.n, a.k, [q.layout for q in a.parts]) == (b.layout, b.n, b.k, [q.layout for q in b.parts])
        assert torch.equal(a.data, b.data), m.sources[0].name
        for qa, qb in zip(a.parts, b.parts):
            assert (qa.data.dtype, qa.data.shape) == (qb.data.dtype, qb.data.shape) and torch.equal(qa.dense(), qb.dense())


def test_a_converted_install_opens_by_map_with_no_packing(installs, monkeypatch):
    _, new, old = installs
    want = turbo.open(str(old))
    want_logits, want_tokens = _logits(want), want.generate(PROMPT, max_new_tokens=16, policy="off").tokens

    def refuse(*args, **kwargs):
        raise AssertionError("packed at open")
    for module, fn in [(native_pack, f) for f in PACKING] + [(native_exact, "exact_panels"), (native_exact, "segments")]:
        monkeypatch.setattr(module, fn, refuse)
    rt = turbo.open(str(new))
    assert rt.trunk.step_name == "native"
    mm = rt.install.index._maps[new / layout_file.PACKED_FILE]
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    for layer in rt.trunk.layers:
        mixer = [getattr(layer.mixer, k) for k in ("in_proj", "out", "qkv", "o") if hasattr(layer.mixer, k)]
        for w in [*mixer, layer.gate_up, layer.down]:
            assert w.layout == "segments" and base <= w.data.data_ptr() < base + len(mm)
            assert all(base <= p.data.data_ptr() < base + len(mm) for p in w.parts)
    assert torch.equal(_logits(rt), want_logits)
    assert rt.generate(PROMPT, max_new_tokens=16, policy="off").tokens == want_tokens


def test_a_quantized_table_is_dequantized_a_row_at_a_time(installs):
    """A GGUF's tied Q8_0 token_embd stays quantized (its head is read as stored) and mapped, not
    read: a step dequantizes the rows it embeds, each as the whole table's dequantization gives it."""
    kind, new, _ = installs
    if kind != "gguf-q8_0":
        pytest.skip("a float table")
    rt = turbo.open(str(new))
    table = rt.trunk.embed
    assert isinstance(table, quant.QuantizedRows) and rt.trunk.step_name == "native"
    mm = rt.install.index._maps[new / "model.safetensors"]
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    w = table.weight
    assert all(base <= t.data_ptr() < base + len(mm) for t in (w.packed, w.scales, w.biases))
    whole = table.weight.dequantize(torch.float32)
    ids = torch.tensor([[0, 5], [17, table.shape[0] - 1]])
    assert torch.equal(table[ids], whole[ids])
    _logits(rt)
    assert table._dense is None  # (never the whole table)


def test_a_host_without_the_formats_packs_what_it_reads(installs, monkeypatch):
    """The layout names each matrix by its parts' layouts: a plan that dequantizes them (fp32
    panels) finds none of its own there and packs them at open, as the install without one."""
    _, new, old = installs
    assert not any(m.mapped for m in _segments(_plan(open_install(new), NO_FORMATS)))
    assert {m.form for layer in _plan(open_install(new), NO_FORMATS).layers for m in layer_matrices(layer)} == {PANELS}
    monkeypatch.setattr(loader, "host", lambda *_: NO_FORMATS)
    a, b = turbo.open(str(new)), turbo.open(str(old))
    assert torch.equal(_logits(a), _logits(b))


def test_a_layout_written_for_a_host_without_them_is_rewritten_once(installs, tmp_path, monkeypatch, capsys):
    """The layout an earlier turbo wrote (version 1, planned for a host without the formats'
    products: none of them in it) is stale: packed at open with one line saying the command; an
    install past CONVERT_BYTES is rewritten once at open; the command rewrites a smaller one."""
    kind, new, old = installs
    want = tokens(old)
    stale = tmp_path / "stale"
    shutil.copytree(new, stale)
    monkeypatch.setattr(layout_file, "LAYOUT_VERSION", 1)
    open_layout.write_layout(open_install(stale), NO_FORMATS)
    monkeypatch.undo()
    install = open_install(stale)
    assert not install.packed and "layout version 1" in install.layout_note
    capsys.readouterr()
    assert tokens(stale) == want
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and f"python -m turbo.load.open_layout {stale} rewrites it" in said[0], said
    if kind == "fp8":  # the command: the layout written, current, mapped
        assert open_layout.main([str(stale)]) == 0
    else:  # an install past CONVERT_BYTES: once, at open
        monkeypatch.setattr(open_layout, "CONVERT_BYTES", 0)
        assert tokens(stale) == want
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1 and "written once into packed.safetensors" in said[0], said
    assert open_install(stale).packed and all(m.mapped for m in _segments(_plan(open_install(stale))))
    assert open_layout.main([str(stale)]) == 0 and "is current" in capsys.readouterr().err
    assert tokens(stale) == want and capsys.readouterr().err == ""


def test_the_command_writes_a_converted_installs_layout(installs, tmp_path, capsys):
    _, _, old = installs
    install = shutil.copytree(old, tmp_path / "install")
    assert open_layout.main([str(install)]) == 0
    assert "wrote" in capsys.readouterr().err
    assert (install / layout_file.PACKED_FILE).read_bytes() == (installs[1] / layout_file.PACKED_FILE).read_bytes()
    assert all(m.mapped for m in _segments(_plan(open_install(install))))


def test_segments_read_in_place_are_the_packed_ones_and_a_damaged_table_is_refused():
    from turbo.errors import TurboError
    from turbo.store import quant
    g = torch.Generator().manual_seed(3)
    w = [torch.randn(n, 128, generator=g) for n in (40, 24)]
    exact = native_exact.exact_panels(quant.QuantizedWeight(*quant.quantize(w[0], quant.EXACT_INT4[32]), 4, 32))
    parts = [exact, native_pack.pack_rows(lambda a, b: w[1][a:b], 24, torch.float32, "panels")]
    whole = native_exact.segments(parts)
    meta = [(40, "exact", torch.uint8, None), (24, "panels", torch.float32, (2, 128, 16))]
    read = native_exact.read_segments(whole.data.clone(), 128, meta, "m")
    assert (read.n, read.k) == (64, 128) and torch.equal(read.dense(), whole.dense())
    assert [(p.layout, p.data.dtype, p.data.shape) for p in read.parts] == \
        [(p.layout, p.data.dtype, p.data.shape) for p in whole.parts]
    for damaged in (meta[::-1], [meta[0], (24, "panel_pairs", torch.bfloat16, (2, 64, 16, 2))], meta[:1]):
        with pytest.raises(TurboError, match="segments table is not the plan's"):
            native_exact.read_segments(whole.data.clone(), 128, damaged, "m")
