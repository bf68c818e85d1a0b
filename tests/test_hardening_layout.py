"""An open layout that proves itself (issue 48): packed.safetensors records a digest over every
byte of the weights it was built from (and their size + mtime, the fast path at open) and a
CRC-32 per packed tensor; bytes of it changed or zeroed, or weights changed anywhere (not only in
sampled windows), leave it unused -- said in one line, the tokens those of the weights -- and
`python -m turbo.load.open_layout` rewrites it; weights touched but unchanged keep it in use."""

import os
import shutil

import pytest

import turbo
from turbo.backends import native_lib
from turbo.load import open_layout
from turbo.repack import repack
from turbo.store import layout_file
from turbo.store.install import open_install
from turbo.store.safetensors_format import read_header
from turbo.testing import make_checkpoint

pytestmark = pytest.mark.skipif(native_lib.library() is None or "int8" not in native_lib.dot_layouts(),
                                reason="the native step with int8 products is not available here")
PROMPT = [3, 17, 5, 99, 42, 7]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layout")
    make_checkpoint(tmp / "src", 0, hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=16,
                    linear_value_head_dim=32)
    inst = repack(tmp / "src", tmp / "inst", quiet=True)
    assert open_install(inst).packed
    return inst, tokens(inst)


def tokens(path) -> list[int]:
    return turbo.open(str(path), backend="cpu", threads=1).generate(PROMPT, max_new_tokens=10, policy="off").tokens


def copied(inst, to):
    shutil.copytree(inst, to)  # (copy2: the weights' mtimes kept)
    return to


def _flip(path, at: int, zero: int = 0) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        old = f.read(max(1, zero))
        f.seek(at)
        f.write(bytes(len(old)) if zero else bytes([old[0] ^ 0x40]))


@pytest.mark.parametrize("damage", ["a byte flipped", "a range zeroed"])
def test_a_damaged_layout_is_not_used_and_is_rewritten(built, tmp_path, capsys, damage):
    inst, want = built
    bad = copied(inst, tmp_path / "bad")
    packed = bad / layout_file.PACKED_FILE
    header = read_header(packed)
    name, t = list(header.tensors.items())[-1]
    _flip(packed, header.data_start + (t.begin + t.end) // 2, zero=4096 if damage == "a range zeroed" else 0)
    install = open_install(bad)
    assert not install.packed and f"damaged: {name}'s bytes do not match the checksum" in install.layout_note
    capsys.readouterr()
    assert tokens(bad) == want
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "damaged" in err[0] and f"python -m turbo.load.open_layout {bad} rewrites it" in err[0], err
    assert open_layout.main([str(bad)]) == 0 and "wrote" in capsys.readouterr().err
    assert open_install(bad).packed and tokens(bad) == want


def test_weights_changed_anywhere_make_the_layout_stale(built, tmp_path, capsys):
    inst, want = built
    other = copied(inst, tmp_path / "other")
    weights = other / "model.safetensors"
    header = read_header(weights)
    span = weights.stat().st_size - header.data_start
    # just past one of the 64 windows of 4 KiB the old fingerprint sampled: it never saw this byte
    _flip(weights, header.data_start + span * 5 // 64 + 5000)
    install = open_install(other)
    assert not install.packed and "written from other weights" in install.layout_note
    assert open_layout.main([str(other)]) == 0 and "wrote" in capsys.readouterr().err
    fresh = open_install(other)
    assert fresh.packed and tokens(other) == tokens(other)  # (the changed weights' own layout, in use)


def test_touched_weights_cost_one_full_check_then_none(built, tmp_path, monkeypatch):
    inst, want = built
    same = copied(inst, tmp_path / "same")  # (a copy: new inodes and ctimes, the first open checks in full)
    calls = []
    real = layout_file.digest
    monkeypatch.setattr(layout_file, "digest", lambda files: calls.append(1) or real(files))
    assert open_install(same).packed and calls == [1]  # the same bytes: still its layout
    assert open_install(same).packed and calls == [1]  # its stat recorded: no full check again
    weights = same / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # touched
    assert open_install(same).packed and calls == [1, 1]
    assert tokens(same) == want


def test_open_layout_calls_a_stale_layout_stale(built, tmp_path, capsys):
    inst, _ = built
    other = copied(inst, tmp_path / "stale")
    _flip(other / "model.safetensors", read_header(other / "model.safetensors").data_start + 9)
    assert open_layout.main([str(other)]) == 0
    err = capsys.readouterr().err
    assert "is current" not in err and err.startswith("wrote")
