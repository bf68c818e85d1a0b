"""One set of stop ids on every path (issue 57): config.json's and generation_config.json's
end-of-generation ids end raw generation as they end a chat, as transformers' `generate` stops
at every id generation_config.json lists; stop_at_eos=False still runs past them."""

from __future__ import annotations

import json

import pytest
import torch

import turbo
from turbo.repack import repack
from turbo.sequence.stops import Finish
from turbo.testing.checkpoints import make_checkpoint

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 99, 3, 250, 41, 8]
CONFIG_EOS = 0
# tiny: this held-out prompt is answered with ``` then <|im_end|> (id 4097, listed only in its
# generation_config.json), where raw generation used to run on to max_new_tokens
CODEC = "class Codec(codecs.Codec):\n\n    def encode(self,input,errors='strict'):\n        " \
        "return codecs.charmap_encode(input,errors,encoding_table)\n\n    def decode(self,input,errors='strict'):\n"
IM_END = 4097


def hf_generate(model, ids: list[int], n: int, **config) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, **config)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def extra_eos(tmp_path_factory):
    """A checkpoint whose config.json says eos 0 and whose generation_config.json adds the id its
    greedy answer gives 5th (one that does not come earlier): transformers stops there."""
    tmp = tmp_path_factory.mktemp("eos")
    src = tmp / "hf"
    model = make_checkpoint(src, seed=3, eos_token_id=CONFIG_EOS)
    free = hf_generate(model, PROMPT, 24, eos_token_id=-1)  # (-1: an id no argmax gives)
    assert CONFIG_EOS not in free[:8]
    extra = free[4]
    assert extra not in free[:4]
    gen = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [CONFIG_EOS, extra]}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(src).float().eval()  # reads generation_config.json
    assert list(hf.generation_config.eos_token_id) == [CONFIG_EOS, extra]
    rt = turbo.open(repack(src, tmp / "install", quiet=True), backend="cpu", threads=1)
    return hf, rt, extra, free


def test_greedy_stops_where_transformers_generate_stops(extra_eos):
    hf, rt, extra, free = extra_eos
    want = hf_generate(hf, PROMPT, 24)  # transformers' own generation config: both eos ids
    assert want == free[:5] and want[-1] == extra
    for policy in ("off", "auto"):
        r = rt.generate(PROMPT, max_new_tokens=24, policy=policy)
        assert r.tokens == want and r.finish == Finish("stop", extra)
    assert rt.generate(PROMPT, max_new_tokens=24, policy="off", stop_at_eos=False).tokens == free


def test_a_stream_and_a_grammar_stop_at_the_same_ids(extra_eos):
    hf, rt, extra, free = extra_eos
    events = list(rt.stream(PROMPT, max_new_tokens=24, policy="off"))
    assert [t for e in events for t in e.tokens] == free[:5] and events[-1].finish == Finish("stop", extra)
    # a grammar's end lets through the stop ids its vocabulary is built with: the same set
    pytest.importorskip("llguidance")
    rt.prepare(PROMPT, None, response_format={"type": "json_object"})
    assert list(rt.grammars.tokenizers) == [tuple(sorted({CONFIG_EOS, extra}))]


def test_tiny_raw_generation_stops_at_its_generation_config_eos():
    rt = turbo.open("tiny", backend="cpu", threads=1)
    assert IM_END in rt.install.eos_ids and IM_END not in rt.install.arch.eos_token_ids
    r = rt.generate(CODEC, max_new_tokens=64, policy="off")
    assert r.finish == Finish("stop", IM_END) and r.tokens[-1] == IM_END and len(r.tokens) == 3
    assert len(rt.generate(CODEC, max_new_tokens=64, policy="off", stop_at_eos=False).tokens) == 64
