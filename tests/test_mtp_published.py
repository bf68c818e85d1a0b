"""The MTP head as a Qwen3.5 checkpoint ships it: `mtp.*` at the top level beside
`model.language_model.*` (the `Qwen3_5ForConditionalGeneration` layout) and
`mtp_num_hidden_layers: 1` in the text config. Repacked as is and drafted with, losslessly;
a config that declares the head while its tensors are missing says so in one line."""

import json

import pytest
from safetensors.torch import load_file, save_file
from test_mtp import mtp_tensors

import turbo
from turbo.errors import TurboError
from turbo.repack import repack
from turbo.store.install import open_install
from turbo.testing import assert_lossless, make_checkpoint

PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [300, 2, 2, 2, 64]]


def conditional_generation(directory, seed: int, with_mtp: bool = True):
    """A random trunk rewritten into the published ConditionalGeneration layout: the text
    model under model.language_model.*, a (stand-in) vision tower under model.visual.*, the
    MTP head under mtp.*, and the text config nested under text_config."""
    import torch

    model = make_checkpoint(directory, seed)
    path = directory / "model.safetensors"
    tensors = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
               for n, t in load_file(str(path)).items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    if with_mtp:
        tensors |= mtp_tensors(model.config, seed)
    save_file(tensors, str(path), metadata={"format": "pt"})
    text = json.loads((directory / "config.json").read_text())
    text.pop("architectures", None)
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": text | {"mtp_num_hidden_layers": 1}, "vision_config": {"depth": 1},
              "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return model


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp_published")
    conditional_generation(tmp / "hf", 6)
    return repack(tmp / "hf", tmp / "install", text_only=True, quiet=True)


@pytest.fixture(scope="module")
def rt(published, step_path):
    return turbo.open(published, backend="cpu")


def test_repack_keeps_the_published_names(published):
    inst = open_install(published)
    assert inst.has_mtp and not inst.has_vision
    for name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.layers.0.self_attn.q_proj.weight",
                 "trunk.layers.0.linear_attn.in_proj_qkv.weight"):
        assert name in inst.index
    assert inst.config["text_config"]["mtp_num_hidden_layers"] == 1


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_drafts_with_its_head_losslessly_every_block(rt, rollback, step_path):
    for prompt in PROMPTS:
        ref = rt.generate(prompt, max_new_tokens=24, policy="off", stop_at_eos=False).tokens
        for block in range(1, 9):
            res = assert_lossless(rt, prompt, ref, block, max_new_tokens=24, drafter="mtp", rollback=rollback,
                                  stop_at_eos=False)
            assert res.stats.drafter == "mtp"
    assert rt.drafter("mtp", None).stepper.name == step_path


def test_auto_picks_the_head_where_no_dflash_drafter_is(rt):
    res = rt.generate(PROMPTS[0], max_new_tokens=6, policy="fixed", block=2, stop_at_eos=False)
    assert res.stats.drafter == "mtp" and res.stats.drafted > 0


def test_a_declared_head_without_its_tensors_says_so(tmp_path, capsys):
    conditional_generation(tmp_path / "hf", 7, with_mtp=False)
    capsys.readouterr()  # (what saving the checkpoint printed)
    out = repack(tmp_path / "hf", tmp_path / "install", text_only=True, quiet=True)
    err = capsys.readouterr().err.strip().splitlines()
    line = "declares mtp_num_hidden_layers 1, but the checkpoint has no mtp.* tensors (mtp.fc.weight is missing)"
    assert len(err) == 1 and line in err[0]
    rt = turbo.open(out, backend="cpu")
    with pytest.raises(TurboError, match="config.json declares mtp_num_hidden_layers 1, but the checkpoint has no"):
        rt.generate(PROMPTS[0], max_new_tokens=4, policy="fixed", block=2, drafter="mtp")
    # issue #34's one rule: a named drafter that is missing is refused under auto too; drafter=auto decodes plainly
    with pytest.raises(TurboError, match="config.json declares mtp_num_hidden_layers 1, but the checkpoint has no"):
        rt.generate(PROMPTS[0], max_new_tokens=4, policy="auto", drafter="mtp")
    assert rt.generate(PROMPTS[0], max_new_tokens=4, policy="auto").stats.drafter is None
