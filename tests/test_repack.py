"""Repack: renames, bit-identical bytes, the resident index, shards, bounded memory, atomicity."""

import json
import tracemalloc

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from turbo.errors import TurboError
from turbo.repack import repack
from turbo.repack import tensors as repack_mod
from turbo.store.install import ResidentIndex, install_has_vision, open_install
from turbo.testing import make_checkpoint


def test_round_trip_is_bit_identical_under_new_names(tmp_path):
    src = tmp_path / "hf"
    make_checkpoint(src, 0)
    out = repack(src, tmp_path / "inst", quiet=True)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        source = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        repacked = {k: f.get_tensor(k) for k in f.keys()}
    expected = {("trunk." + k[len("model."):] if k.startswith("model.") else "trunk." + k): v
                for k, v in source.items()}
    assert set(repacked) == set(expected)
    for name, t in expected.items():
        assert repacked[name].dtype == t.dtype and torch.equal(repacked[name].view(-1).view(torch.uint8),
                                                              t.contiguous().view(-1).view(torch.uint8))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes()


def test_index_reports_documented_shapes_and_codes(tmp_path):
    src = tmp_path / "hf"
    model = make_checkpoint(src, 0)
    model.to(torch.bfloat16).save_pretrained(src)
    inst = open_install(repack(src, tmp_path / "inst", quiet=True))
    idx = inst.index
    e = idx.need("trunk.layers.0.input_layernorm.weight")
    assert e.dtype == 1 and e.shape == (64, 0, 0, 0)
    conv = idx.need("trunk.layers.0.linear_attn.conv1d.weight")
    assert conv.shape == (64, 1, 4, 0)
    assert idx.need("trunk.lm_head.weight").shape == (320, 64, 0, 0)
    assert all(e.dtype == 1 for e in idx.entries.values())
    assert not inst.has_dflash and not inst.has_mtp and not inst.has_vision
    # the index is a header view: offsets point at the tensor's bytes
    t = idx.load("trunk.norm.weight")
    assert torch.equal(t, model.model.norm.weight.detach().to(torch.bfloat16))


def test_index_codes_for_f32_and_f16(tmp_path):
    save_file({"a": torch.zeros(3, dtype=torch.float32), "b": torch.zeros(2, 5, dtype=torch.float16),
               "c": torch.zeros(2, 3, 4, dtype=torch.bfloat16)}, str(tmp_path / "x.safetensors"))
    idx = ResidentIndex([tmp_path / "x.safetensors"])
    assert (idx.need("a").dtype, idx.need("a").shape) == (3, (3, 0, 0, 0))
    assert (idx.need("b").dtype, idx.need("b").shape) == (2, (2, 5, 0, 0))
    assert (idx.need("c").dtype, idx.need("c").shape) == (1, (2, 3, 4, 0))


def conditional_generation_checkpoint(path, sharded=True):
    """A Qwen3_5ForConditionalGeneration-layout checkpoint (vision tower, mtp head), in shards."""
    src_model = path.parent / (path.name + "_causal")
    make_checkpoint(src_model, 0)
    with safe_open(str(src_model / "model.safetensors"), "pt") as f:
        tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: f.get_tensor(k)
                   for k in f.keys()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, 2)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    path.mkdir()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(path / file))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    text = json.loads((src_model / "config.json").read_text())
    cfg = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
           "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer.json").write_bytes((src_model / "tokenizer.json").read_bytes())
    return tensors


def test_conditional_generation_shards_rename(tmp_path):
    tensors = conditional_generation_checkpoint(tmp_path / "cg")
    inst = open_install(repack(tmp_path / "cg", tmp_path / "inst", quiet=True))
    assert "trunk.layers.0.linear_attn.A_log" in inst.index
    assert "trunk.lm_head.weight" in inst.index
    assert "vision.patch_embed.proj.weight" in inst.index and install_has_vision(inst.index)
    assert "mtp.fc.weight" in inst.index and inst.has_mtp
    assert len(inst.index.entries) == len(tensors)
    text_only = open_install(repack(tmp_path / "cg", tmp_path / "inst2", text_only=True, quiet=True))
    assert not text_only.has_vision and "vision_config" not in text_only.config


def test_peak_memory_bounded_by_largest_tensor(tmp_path):
    src = tmp_path / "big"
    make_checkpoint(src, 0)
    # add four 8 MiB tensors; a whole-model load would need 32 MiB
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for i in range(4):
        tensors[f"mtp.extra{i}.weight"] = torch.randn(1024, 2048)
    save_file(tensors, str(src / "model.safetensors"))
    largest = 1024 * 2048 * 4
    tracemalloc.start()
    repack(src, tmp_path / "inst", quiet=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < largest + 2 * 1024 * 1024, peak


def test_interrupted_repack_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "hf"
    make_checkpoint(src, 0)
    calls = []

    def boom(out):
        calls.append(1)
        raise KeyboardInterrupt

    original = repack_mod.plan_copy

    def plan_copy(*a):
        p = original(*a)
        if p.name.endswith("norm.weight"):
            p.write = boom
        return p

    monkeypatch.setattr(repack_mod, "plan_copy", plan_copy)
    with pytest.raises(KeyboardInterrupt):
        repack(src, tmp_path / "inst", quiet=True)
    assert calls and not (tmp_path / "inst").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_refusals_name_the_thing(tmp_path):
    src = tmp_path / "hf"
    make_checkpoint(src, 0)
    with pytest.raises(TurboError, match="already exists"):
        repack(src, src, quiet=True)
    with pytest.raises(TurboError, match="no such checkpoint directory"):
        repack(tmp_path / "nope", tmp_path / "o", quiet=True)
    with pytest.raises(TurboError, match="no such drafter directory"):
        repack(src, tmp_path / "o", drafter=tmp_path / "nodrafter", quiet=True)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")
    with pytest.raises(TurboError, match="architectures"):
        repack(src, tmp_path / "o", drafter=tmp_path / "bad", quiet=True)
    assert not (tmp_path / "o").exists()
