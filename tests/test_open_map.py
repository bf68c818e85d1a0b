"""Open = map (turbo/store/layout_file.py, turbo/load/open_layout.py): an install repacked now carries the
native step's matrices as it reads them, and opening maps them with no packing work, giving the
bytes and the tokens of the install packed at open (the same install without its layout); an
install written before opens (converted once where it is large, else packed at open as before),
and a layout it cannot use is said in one line with the command that rewrites it."""

import ctypes
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import turbo
from turbo.backends import native_lib, native_pack
from turbo.load import open_layout
from turbo.load.load_plan import COPY, PACKED, PANELS, layer_matrices, plan_trunk
from turbo.load.loader import host
from turbo.load.reader import Reader
from turbo.repack import repack
from turbo.sequence.options import OpenOptions
from turbo.store import layout_file
from turbo.store.install import open_install
from turbo.store.safetensors_format import write_safetensors
from turbo.testing import make_checkpoint, make_moe_checkpoint

WIDE = dict(hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=32)
MOE = dict(hidden_size=128, intermediate_size=128, head_dim=32, moe_intermediate_size=64,
           shared_expert_intermediate_size=64, linear_key_head_dim=16, linear_value_head_dim=16)
# name: (checkpoint, --quant); each exercises its layouts (fp32 panels, bf16 panel pairs and a tied
# head read out of its panels, q4 with the tied head's quantized copy, q8, an MoE block's experts)
KINDS = {"f32": ("f32", "none"), "bf16-tied": ("bf16-tied", "none"), "int4-tied": ("bf16-tied", "int4"),
         "int8": ("f32", "int8"), "moe": ("moe", "none"), "moe-int4": ("moe", "int4")}
PROMPT = [3, 17, 5, 99, 42, 7]
PACKING = ("pack_rows", "quantized_panels", "quantized_copy", "_panels_by_slices")

needs_native = pytest.mark.skipif(native_lib.library() is None or "int8" not in native_lib.dot_layouts(),
                                  reason="the native step with int8 products is not available here")


def _to_bf16(src: Path) -> None:
    f = src / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("ckpt")
    make_checkpoint(tmp / "f32", 0, **WIDE)
    make_checkpoint(tmp / "bf16-tied", 1, tie_word_embeddings=True, **WIDE)
    _to_bf16(tmp / "bf16-tied")
    make_moe_checkpoint(tmp / "moe", **MOE)
    return {name: tmp / name for name in ("f32", "bf16-tied", "moe")}


@pytest.fixture(scope="module")
def installs(checkpoints, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (the install repacked now, a copy of it without its layout: an older repack's)."""
    tmp, out = tmp_path_factory.mktemp("installs"), {}
    for name, (src, fmt) in KINDS.items():
        new = repack(checkpoints[src], tmp / name, quiet=True, quant=fmt)
        old = tmp / f"{name}-old"
        shutil.copytree(new, old)
        (old / layout_file.PACKED_FILE).unlink()
        out[name] = new, old
    return out


def tokens(path: Path, **opts) -> list[int]:
    return turbo.open(str(path), **opts).generate(PROMPT, max_new_tokens=10, policy="off").tokens


def _plan(install):
    opts = OpenOptions()
    return plan_trunk(install.index.entries, install.arch, opts, torch.device("cpu"), host(opts, torch.device("cpu")),
                      install.index.packed)


def _matrices(plan):
    return [m for m in [plan.embed.head, *(m for layer in plan.layers for m in layer_matrices(layer))]
            if m is not None and m.form in (PANELS, PACKED, COPY)]


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_the_layout_is_the_bytes_packed_at_open(installs, kind):
    new, old = (open_install(p) for p in installs[kind])
    assert new.packed and not old.packed and new.layout_note is None is old.layout_note
    mapped, packed = _matrices(_plan(new)), _matrices(_plan(old))
    assert len(mapped) == len(packed) > 0 and all(m.mapped for m in mapped) and not any(m.mapped for m in packed)
    rn, ro = Reader(new.index, torch.float32), Reader(old.index, torch.float32)
    plan_old = _plan(old)
    for m, p in zip(mapped, packed):
        a = rn.head_copy(_plan(new).embed) if m.form == COPY else rn.matrix(m)
        b = ro.head_copy(plan_old.embed) if p.form == COPY else ro.matrix(p)
        assert (a.layout, a.n, a.k) == (b.layout, b.n, b.k)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), m.sources[0].name


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_opening_maps_with_no_packing(installs, kind, monkeypatch):
    new, old = installs[kind]
    before = tokens(old)

    def refuse(*args, **kwargs):
        raise AssertionError("packed at open")
    for fn in PACKING:
        monkeypatch.setattr(native_pack, fn, refuse)
    rt = turbo.open(str(new))
    assert rt.trunk.step_name == "native"
    # the matrices are the mapped file's pages (its copy-on-write map, never written)
    mm = rt.install.index._maps[new / layout_file.PACKED_FILE]
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    layer = rt.trunk.layers[0]
    for w in [layer.mixer.in_proj, layer.mixer.out, *(layer.moe.gate_up if layer.moe else [layer.gate_up])]:
        assert base <= w.data.data_ptr() < base + len(mm)
    assert rt.generate(PROMPT, max_new_tokens=10, policy="off").tokens == before


@pytest.mark.parametrize("kind", ["bf16-tied", "int4-tied"])
def test_the_torch_step_reads_the_weights_as_before(installs, kind):
    new, old = installs[kind]
    assert tokens(new, native=False) == tokens(old, native=False)


def test_layout_sizes_stated(installs):
    """The layout's cost on disk: about the matrices' bytes again (kept beside the originals,
    which the torch step and the drafters read), plus a tied int4 head's copy."""
    for name, (new, _) in installs.items():
        weights, packed = ((new / f).stat().st_size for f in ("model.safetensors", layout_file.PACKED_FILE))
        assert packed < 1.3 * weights, (name, packed / weights)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_the_shipped_tiny_opens_as_before():
    tiny = open_install("tiny")
    assert not tiny.packed and tiny.layout_note is None
    assert not (tiny.path / layout_file.PACKED_FILE).exists()


@needs_native
def test_an_older_install_is_converted_once(installs, tmp_path, monkeypatch, capsys):
    _, old = installs["int4-tied"]
    old = _copy(old, tmp_path / "old")
    want = tokens(installs["int4-tied"][1])
    capsys.readouterr()
    monkeypatch.setattr(open_layout, "CONVERT_BYTES", 0)
    assert tokens(old) == want
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "written once into packed.safetensors" in said[0], said
    assert open_install(old).packed
    for fn in PACKING:
        monkeypatch.setattr(native_pack, fn, None)
    assert tokens(old) == want and capsys.readouterr().err == ""


@needs_native
def test_an_older_install_that_cannot_be_written_says_the_command(installs, tmp_path, monkeypatch, capsys):
    old = _copy(installs["int8"][1], tmp_path / "old")
    monkeypatch.setattr(open_layout, "CONVERT_BYTES", 0)

    def read_only(*args, **kwargs):  # (a read-only directory: as root, chmod would not stop the write)
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(open_layout, "write_layout", read_only)
    capsys.readouterr()
    assert tokens(old) == tokens(installs["int8"][0])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"python -m turbo.load.open_layout {old} writes it" in err[0], err
    assert not (old / layout_file.PACKED_FILE).exists()


@needs_native
def test_a_layout_it_cannot_use_is_said_and_rewritten(installs, tmp_path, capsys):
    new, _ = installs["bf16-tied"]
    want = tokens(new)
    stale = _copy(new, tmp_path / "stale")
    write_safetensors(stale / layout_file.PACKED_FILE, [], metadata={layout_file.VERSION_KEY: "0"})
    capsys.readouterr()
    assert tokens(stale) == want
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "layout version 0" in err[0] and f"python -m turbo.load.open_layout {stale} rewrites it" in err[0]
    assert open_layout.main([str(stale)]) == 0
    assert open_install(stale).packed and tokens(stale) == want
    # weights replaced under a layout: its fingerprint no longer matches them, the layout is not read
    other = _copy(new, tmp_path / "other")
    shutil.copy(installs["f32"][0] / layout_file.PACKED_FILE, other / layout_file.PACKED_FILE)
    install = open_install(other)
    assert not install.packed and "written from other weights" in install.layout_note


def test_the_layout_is_aligned_and_versioned(installs):
    new, _ = installs["int4-tied"]
    header = json.loads((new / layout_file.PACKED_FILE).read_bytes()[8:8 + int.from_bytes(
        (new / layout_file.PACKED_FILE).read_bytes()[:8], "little")])
    assert header["__metadata__"][layout_file.VERSION_KEY] == str(layout_file.LAYOUT_VERSION)
    start = 8 + int.from_bytes((new / layout_file.PACKED_FILE).read_bytes()[:8], "little")
    assert start % layout_file.ALIGN == 0
    assert all(v["data_offsets"][0] % layout_file.ALIGN == 0 for k, v in header.items() if k != "__metadata__")
    assert any(k.startswith("packed.q4.trunk.embed_tokens") for k in header)  # the tied head's quantized copy


def test_no_open_layout_keeps_the_install_small(checkpoints, installs, tmp_path):
    """repack --no-open-layout: a layout of no matrices (current: never converted), packed at open."""
    from turbo.repack import main

    out = tmp_path / "small"
    assert main([str(checkpoints["f32"]), str(out), "--quiet", "--no-open-layout"]) == 0
    install = open_install(out)
    assert install.packed and not install.index.packed and install.layout_note is None
    assert (out / layout_file.PACKED_FILE).stat().st_size < 4096
    assert tokens(out) == tokens(installs["f32"][0])
