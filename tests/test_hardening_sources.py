"""Converted sources that cannot be accepted wrong (issue 48): a GGUF whose tensor table is
misaligned, overlapping, retyped, has a zero dimension, a shape the config does not imply, or a
block count past the tensors present is refused in one line before anything is written."""

import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from test_repack_gguf import dense, gguf_of  # noqa: E402,F401 (the module's fixture)
from turbo.repack import main  # noqa: E402


def _offsets(path, name: str) -> dict[str, int]:
    """The file offsets of tensor `name`'s info fields: its dims, type and data offset."""
    r = gguf.GGUFReader(path)
    t = next(t for t in r.tensors if t.name == name)
    at = lambda part: part.ctypes.data - r.data.ctypes.data  # noqa: E731
    return {"dims": at(t.field.parts[3]), "type": at(t.field.parts[-2]), "offset": at(t.field.parts[-1]),
            "n_dims": len(t.shape)}


def _by_offset(path) -> list[str]:
    return [t.name for t in sorted(gguf.GGUFReader(path).tensors, key=lambda t: t.data_offset)]


def _u64(data: bytearray, at: int) -> int:
    return int.from_bytes(data[at:at + 8], "little")


def damaged(path, damage: str) -> bytes:
    data = bytearray(path.read_bytes())
    first, second = _by_offset(path)[:2]
    a, b = _offsets(path, first), _offsets(path, second)
    if damage == "misaligned":
        data[a["offset"]:a["offset"] + 8] = (_u64(data, a["offset"]) + 16).to_bytes(8, "little")
    elif damage == "overlap":
        data[b["offset"]:b["offset"] + 8] = data[a["offset"]:a["offset"] + 8]
    elif damage == "retyped":  # Q8_0 -> F32: its bytes now run over its neighbour's
        data[a["type"]:a["type"] + 4] = (0).to_bytes(4, "little")
    elif damage == "zero dim":
        data[a["dims"]:a["dims"] + 8] = (0).to_bytes(8, "little")
    elif damage == "swapped dims":
        r = gguf.GGUFReader(path)
        t = next(t for t in r.tensors if t.name.startswith("blk.0.") and len(t.shape) == 2
                 and t.shape[0] != t.shape[1])
        o = _offsets(path, t.name)
        d0, d1 = _u64(data, o["dims"]), _u64(data, o["dims"] + 8)
        data[o["dims"]:o["dims"] + 16] = d1.to_bytes(8, "little") + d0.to_bytes(8, "little")
    elif damage == "block count":
        r = gguf.GGUFReader(path)
        f = r.fields["qwen35.block_count"]
        at = f.parts[-1].ctypes.data - r.data.ctypes.data
        data[at:at + 4] = (int(f.contents()) + 1).to_bytes(4, "little")
    return bytes(data)


@pytest.mark.parametrize("damage, says", [
    ("misaligned", "expected a multiple of general.alignment 32"),
    ("overlap", "overlap (bytes"),
    ("retyped", "overlap (bytes"),
    ("zero dim", "expected every dimension >= 1"),
    ("swapped dims", "from the metadata's config"),
    ("block count", "which the metadata's config needs (a block count larger than the tensors present?)"),
])
def test_a_gguf_table_that_cannot_be_right_is_refused_before_writing(dense, tmp_path, capsys, damage, says):  # noqa: F811
    src, _ = dense
    path = tmp_path / "bad.gguf"
    path.write_bytes(damaged(gguf_of(src, "Q8_0", mtp="none"), damage))
    assert main([str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]
