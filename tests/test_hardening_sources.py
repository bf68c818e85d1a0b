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
    elif damage == "retyped smaller":  # Q8_0 -> Q4_0: same shape, fewer bytes, its neighbour where it was
        data[a["type"]:a["type"] + 4] = (2).to_bytes(4, "little")
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
    ("retyped smaller", "bytes unaccounted for between tensors"),
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


def _hf_source(tmp_path, kind: str):
    from test_repack_formats import _source

    return _source(tmp_path, kind, group=128)[1]


def _refused(tmp_path, capsys, src, says: str) -> None:
    capsys.readouterr()
    assert main([str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_an_awq_module_without_qzeros_is_one_line(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    src = _hf_source(tmp_path, "awq")
    state = load_file(str(src / "model.safetensors"))
    name = next(n for n in state if n.endswith(".qzeros"))
    del state[name]
    save_file(state, str(src / "model.safetensors"))
    _refused(tmp_path, capsys, src, f"its module has no {name.rsplit('.', 2)[-2]}.qzeros tensor")


@pytest.mark.parametrize("text, says", [
    ("{not json", "not a tokenizers file"),
    ('{"version": "1.0", "model": {"type": "Nope"}}', "not a tokenizers file"),
])
def test_a_malformed_tokenizer_json_is_refused_at_repack(tmp_path, capsys, text, says):
    from turbo.testing import make_checkpoint

    src = tmp_path / "src"
    make_checkpoint(src, 0, num_hidden_layers=2)
    (src / "tokenizer.json").write_text(text)
    _refused(tmp_path, capsys, src, says)
