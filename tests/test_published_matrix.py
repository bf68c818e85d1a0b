"""The published checkpoint matrix (issue #47): every Qwen3.5-family layout a user downloads, as
turbo/testing/published.py scales it down and transformers' own classes build and save it, goes
through repack, opens, decodes 32 greedy tokens equal to transformers', chats through its own
template, answers one server request, sees an image where it has a tower (as transformers sees
it) and drafts losslessly with its MTP head where it ships one; and turbo reads every config
field as transformers' config classes resolve it (top level vs text_config, defaults). A layout
the runtime cannot open is refused by repack in one line."""

from __future__ import annotations

import base64
import copy
import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import turbo
from turbo.chat.template import encode, render
from turbo.drafters.mtp import declared_layers
from turbo.repack import main as repack_main
from turbo.store import quant
from turbo.store.arch import arch_from_config
from turbo.store.install import open_install
from turbo.testing import assert_lossless
from turbo.testing.published import (IMAGE_ID, LAYOUTS, TEMPLATE, carries_mtp, has_tower, make_published,
    published_config)
from turbo.vision.runtime import Vision

transformers = pytest.importorskip("transformers")

# The 0.8B layout again as transformers writes it when the tie is given at the top level alone
# (Qwen3_5Config(text_config=..., vision_config=..., tie_word_embeddings=True)): its text config
# then says false, and transformers saves no lm_head.
TIED_AS_TRANSFORMERS_WRITES = "qwen3.5-0.8b-as-transformers-writes"
PROMPT = [5, 17, 99, 3, 250, 41, 8]


def tied_as_transformers_writes() -> dict:
    published = published_config("qwen3.5-0.8b")
    text = {k: v for k, v in published["text_config"].items() if k != "tie_word_embeddings"}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=published["vision_config"],
                                        tie_word_embeddings=True,
                                        **{k: published[k] for k in ("image_token_id", "video_token_id",
                                                                     "vision_start_token_id", "vision_end_token_id")})
    written = config.to_dict() | {"architectures": ["Qwen3_5ForConditionalGeneration"]}
    assert written["tie_word_embeddings"] is True and written["text_config"]["tie_word_embeddings"] is False
    return written


ENTRIES = [*LAYOUTS, TIED_AS_TRANSFORMERS_WRITES]


def config_of(name: str) -> dict:
    return tied_as_transformers_writes() if name == TIED_AS_TRANSFORMERS_WRITES else published_config(name)


def hf_greedy(model, ids: list[int], n: int, **inputs) -> list[int]:
    """n greedy tokens from transformers' generate. Its eos is set to -1, an id no argmax gives:
    min_new_tokens would instead forbid eos, and a random model picks it as any other id."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = -1
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=config, max_new_tokens=n, do_sample=False,
                             **inputs)
    return out[0, len(ids):].tolist()


def assert_answer_is(ours: list[int], ref: list[int]) -> None:
    """A chat's answer is transformers' greedy tokens up to the end of its turn (eos, id 0: the
    chat stops there, transformers' `ref` runs on)."""
    assert ours and ours == ref[:len(ours)] and (len(ours) == len(ref) or ours[-1] == 0)


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def image_chat(seed: int = 0) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(png(seed)).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is it?"}]}]


@pytest.fixture(scope="module", params=ENTRIES)
def entry(request, tmp_path_factory):
    """The layout's checkpoint, repacked by the CLI (a refusal fails here, in one line), opened."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    config = config_of(name)
    model = make_published(tmp / "hf", name, config=config)
    assert repack_main([str(tmp / "hf"), str(tmp / "install"), "--quiet"]) == 0  # (python -m turbo.repack's)
    return SimpleNamespace(name=name, config=config, model=model, install=tmp / "install",
                           rt=turbo.open(tmp / "install", backend="cpu", threads=1))


def test_repacks_and_opens_with_every_part(entry):
    inst = entry.rt.install
    assert inst.has_vision == has_tower(entry.config)
    assert inst.has_mtp == carries_mtp(entry.config)
    tied = entry.config["tie_word_embeddings"]
    assert inst.arch.tie_embeddings == tied and ("trunk.lm_head.weight" in inst.index) == (not tied)
    fp8 = "quantization_config" in entry.config  # an FP8 edition: its codes and block scales kept
    assert (inst.index.need("trunk.layers.3.self_attn.q_proj.weight").dtype == quant.FP8.code) == fp8


def test_32_greedy_tokens_equal_transformers(entry):
    ours = entry.rt.generate(PROMPT, max_new_tokens=32, policy="off", stop_at_eos=False).tokens
    assert ours == hf_greedy(entry.model, PROMPT, 32)


def test_chats_through_its_template(entry):
    messages = [{"role": "user", "content": "def f(x):"}]
    res = entry.rt.chat(messages, max_new_tokens=12, policy="off")
    ids = encode(entry.rt.tokenizer, render(TEMPLATE, messages, add_generation_prompt=True))
    assert res.prompt_tokens == ids
    assert_answer_is(res.tokens, hf_greedy(entry.model, ids, 12))


def test_sees_an_image_as_transformers_does(entry):
    if not has_tower(entry.config):
        pytest.skip("a text-only layout (no vision tower)")
    messages = image_chat()
    res = entry.rt.chat(messages, max_new_tokens=12, policy="off")
    vis = Vision.from_install(open_install(entry.install))
    image = Image.open(io.BytesIO(png(0))).convert("RGB")
    ids, _ = vis.prompt(res.prompt_tokens, [image])  # one placeholder per merged patch, as transformers' processor
    (prep,) = vis.prepare([image])
    t, h, w = prep.grid
    assert res.prompt_tokens.count(IMAGE_ID) == 1 and ids.count(IMAGE_ID) == t * h * w // 4  # 2 x 2 merged
    ref = hf_greedy(entry.model, ids, 12, pixel_values=prep.pixels, image_grid_thw=torch.tensor([prep.grid]),
                    mm_token_type_ids=(torch.tensor([ids]) == IMAGE_ID).int())
    assert_answer_is(res.tokens, ref)
    # (and the image is seen: another image's pixels move the next token's logits)
    other = Image.open(io.BytesIO(png(1))).convert("RGB")
    trunk, last = entry.rt.trunk, []
    for im in (image, other):
        tokens, mm = vis.prompt(res.prompt_tokens, [im])
        last.append(trunk.prefill(trunk.new_state(), tokens, want_logits=True, mm=mm).logits[-1])
    assert (last[0] - last[1]).abs().max().item() > 1e-3


def test_one_request_through_the_server(entry):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from turbo.sequence.options import GenerationOptions, OpenOptions
    from turbo.serve.app import make_app
    from turbo.serve.settings import ServeConfig
    from turbo.serve.worker import Engine

    messages = image_chat() if has_tower(entry.config) else [{"role": "user", "content": "def f(x):"}]
    engine = Engine(str(entry.install), OpenOptions(backend="cpu", threads=1), GenerationOptions(), ServeConfig())
    engine.start()
    try:
        r = TestClient(make_app(engine)).post("/v1/chat/completions", json={
            "model": engine.model, "messages": messages, "max_tokens": 8, "temperature": 0})
    finally:
        engine.stop()
    assert r.status_code == 200, r.text
    want = entry.rt.chat(messages, max_new_tokens=8, policy="off").message["content"]
    assert r.json()["choices"][0]["message"]["content"] == want and r.json()["usage"]["completion_tokens"] > 0


def test_drafts_losslessly_with_its_mtp_head(entry):
    if not carries_mtp(entry.config):
        pytest.skip("the layout ships no MTP head")
    ref = entry.rt.generate(PROMPT, max_new_tokens=16, policy="off", stop_at_eos=False).tokens
    for block in (1, 3):
        res = assert_lossless(entry.rt, PROMPT, ref, block, max_new_tokens=16, drafter="mtp", stop_at_eos=False)
        assert res.stats.drafter == "mtp"


@pytest.mark.parametrize("entry", [TIED_AS_TRANSFORMERS_WRITES], indirect=True)
def test_the_cli_generates_from_the_tied_checkpoint(entry, tmp_path):
    """The report's own steps: `python -m turbo install.path=DST` (it refused to open before)."""
    cmd = [sys.executable, "-m", "turbo", f"install.path={entry.install}", "backend=cpu", "threads=1", "prompt=def f",
           "max_new_tokens=6", "stop_at_eos=false", "+policy=off"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    want = entry.rt.generate("def f", max_new_tokens=6, policy="off", stop_at_eos=False)
    assert proc.stdout == want.text and "generated 6 tok" in proc.stderr


def text_fields(arch) -> dict:
    return dict(hidden=arch.hidden, num_layers=arch.num_layers, num_heads=arch.num_heads, kv=arch.num_kv_heads,
                head_dim=arch.head_dim, eps=arch.rms_eps, vocab=arch.vocab, layer_types=list(arch.layer_types),
                lin=(arch.lin_k_heads, arch.lin_v_heads, arch.lin_k_dim, arch.lin_v_dim), conv=arch.conv_kernel,
                theta=arch.rope_theta, partial=arch.partial_rotary, max_positions=arch.max_positions,
                experts=(arch.num_experts, arch.experts_per_token, arch.moe_intermediate, arch.shared_intermediate,
                         arch.norm_topk_prob, list(arch.moe_layers)),
                intermediate=arch.intermediate, scaling=arch.rope_scaling and arch.rope_scaling.kind,
                eos=list(arch.eos_token_ids))


def transformers_fields(top, text) -> dict:
    """The same fields as transformers' config classes resolve them (`top`: the class that
    holds the lm_head; `text`: its get_text_config())."""
    rope = text.rope_parameters
    moe = getattr(text, "num_experts", 0) or 0
    sparse = getattr(text, "decoder_sparse_step", 1) or 1
    dense = getattr(text, "mlp_only_layers", None) or []
    layers = [i for i in range(text.num_hidden_layers) if i not in dense and (i + 1) % sparse == 0] if moe else []
    eos = text.eos_token_id
    return dict(hidden=text.hidden_size, num_layers=text.num_hidden_layers, num_heads=text.num_attention_heads,
                kv=text.num_key_value_heads, head_dim=text.head_dim, eps=text.rms_norm_eps, vocab=text.vocab_size,
                layer_types=list(text.layer_types),
                lin=(text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
                     text.linear_value_head_dim), conv=text.linear_conv_kernel_dim, theta=rope["rope_theta"],
                partial=rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None)),
                max_positions=text.max_position_embeddings,
                experts=(moe, getattr(text, "num_experts_per_tok", 0) if moe else 0,
                         getattr(text, "moe_intermediate_size", 0) if moe else 0,
                         getattr(text, "shared_expert_intermediate_size", 0) if moe else 0,
                         getattr(text, "norm_topk_prob", True) if text.model_type == "qwen3_next" else True, layers),
                intermediate=getattr(text, "intermediate_size", 0) if len(layers) < text.num_hidden_layers else 0,
                scaling=None if rope.get("rope_type", "default") == "default" else rope["rope_type"],
                eos=[] if eos is None else eos if isinstance(eos, list) else [eos])


@pytest.mark.parametrize("form", ["published", "as transformers saves it"])
@pytest.mark.parametrize("name", ENTRIES)
def test_parsed_architecture_equals_transformers(name, form, tmp_path):
    """Parsing alone (no weights): the config.json as published, and as transformers writes it
    back after reading it (rope fields moved into rope_parameters, defaults filled in)."""
    config = config_of(name)
    (tmp_path / "config.json").write_text(json.dumps(config))
    top = transformers.AutoConfig.from_pretrained(tmp_path)
    if form != "published":
        top.save_pretrained(tmp_path)
        config = json.loads((tmp_path / "config.json").read_text())
        top = transformers.AutoConfig.from_pretrained(tmp_path)
    arch = arch_from_config(config)
    assert text_fields(arch) == transformers_fields(top, top.get_text_config())
    # the lm_head belongs to the class `architectures` names: its config's flag ties it
    model_class = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        model = model_class(top)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert arch.tie_embeddings == top.tie_word_embeddings == tied
    assert declared_layers(config) == getattr(top.get_text_config(), "mtp_num_hidden_layers", 0)


def test_an_untied_config_without_its_lm_head_is_refused_at_repack(tmp_path, capsys):
    """A checkpoint whose config (read as transformers reads it) calls for a head it lacks is
    refused by repack in one line, before anything is written, not accepted and refused at open."""
    config = published_config("qwen3.5-0.8b")
    make_published(tmp_path / "hf", "qwen3.5-0.8b", config=config)
    config["tie_word_embeddings"] = False  # the top level: what transformers' model class reads
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # (what saving the checkpoint printed)
    assert repack_main([str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    said = capsys.readouterr()
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    assert said.out == "" and said.err.count("\n") == 1 and said.err.startswith("error: ") and \
        "tie_word_embeddings is false, but the checkpoint has no lm_head.weight" in said.err, said.err
