"""A tokenizer that does not cover the model's vocabulary (issue 57) is refused by name at repack
and at open: one that ends more than padding (install_check.PADDING_ROWS) before the model's rows,
or that lacks an id generation stops at. A model padded past its tokenizer, as Qwen3.5's 248,320
rows are past its 248,077 ids, opens."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

import turbo
from turbo.errors import TurboError
from turbo.load.install_check import PADDING_ROWS, check_tokenizer
from turbo.testing.checkpoints import tiny_tokenizer

TINY_ROWS, IM_START, IM_END = 4100, 4096, 4097


@pytest.fixture(scope="module")
def tiny_path():
    return turbo.open("tiny", backend="cpu").install.path


def copy_with(tmp_path, tiny_path, tokenizer: Tokenizer):
    dst = tmp_path / "inst"
    shutil.copytree(tiny_path, dst)
    tokenizer.save(str(dst / "tokenizer.json"))
    return dst


def below(tokenizer: Tokenizer, end: int) -> Tokenizer:
    """The tokenizer's ids below `end` alone (its base vocabulary without the chat's added tokens):
    inside the padding bound, without the eos id <|im_end|>."""
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < end]
    spec["model"]["vocab"] = {t: j for t, j in spec["model"]["vocab"].items() if j < end}
    return Tokenizer.from_str(json.dumps(spec))


def test_a_tokenizer_far_smaller_than_the_model_is_refused_at_open(tmp_path, tiny_path):
    dst = copy_with(tmp_path, tiny_path, tiny_tokenizer(100))
    with pytest.raises(TurboError, match=rf"tokenizer\.json: the tokenizer's ids end at 257 \(a vocabulary of 258\) "
                                         rf"for the model's vocab_size {TINY_ROWS}, expected at least 3077") as e:
        turbo.open(dst, backend="cpu")
    assert "\n" not in str(e.value)


def test_a_tokenizer_without_an_eos_id_is_refused_at_open(tmp_path, tiny_path):
    dst = copy_with(tmp_path, tiny_path, below(Tokenizer.from_file(str(tiny_path / "tokenizer.json")), IM_START))
    with pytest.raises(TurboError, match=rf"tokenizer\.json: the tokenizer has no token {IM_END}, an eos_token_id of "
                                         r"config\.json or generation_config\.json"):
        turbo.open(dst, backend="cpu")


def test_padding_rows_past_the_tokenizer_are_fine_up_to_the_bound():
    tok = tiny_tokenizer(320)
    check_tokenizer(tok, 320 + PADDING_ROWS - 1, "t", (0,))  # Qwen3.5's 243 rows of padding are inside it
    with pytest.raises(TurboError, match="ids end at 319"):
        check_tokenizer(tok, 320 + PADDING_ROWS, "t", (0,))
    assert Tokenizer.from_str(tok.to_str()).get_vocab_size() == 320  # (the fixture spans the ids it is asked for)


@pytest.mark.parametrize("cut", ["size", "eos"])
def test_repack_refuses_a_tokenizer_that_does_not_cover_the_model(tmp_path, cut):
    pytest.importorskip("transformers")
    from turbo.testing import make_checkpoint

    src = tmp_path / "src"
    make_checkpoint(src, 0, num_hidden_layers=2, vocab_size=TINY_ROWS, eos_token_id=0)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, IM_END]}))
    tok = tiny_tokenizer(100) if cut == "size" else below(tiny_tokenizer(TINY_ROWS), IM_START)
    tok.save(str(src / "tokenizer.json"))
    done = subprocess.run([sys.executable, "-m", "turbo.repack", str(src), str(tmp_path / "out")],
                          capture_output=True, text=True)
    says = "ids end at 257" if cut == "size" else f"has no token {IM_END}"
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()



def test_a_shapes_cache_built_before_the_rule_is_brought_up_to_date(tmp_path):
    from turbo.testing.shapes import refresh_tokenizers

    for part in ("hf", "install", "install-int4"):
        (tmp_path / part).mkdir()
        below(tiny_tokenizer(320), 318).save(str(tmp_path / part / "tokenizer.json"))  # (the 318 ids it had then)
    refresh_tokenizers(tmp_path, 4096)
    for part in ("hf", "install", "install-int4"):
        tok = Tokenizer.from_file(str(tmp_path / part / "tokenizer.json"))
        check_tokenizer(tok, 4096, part, (0,))
        assert tok.encode("def f(x):").ids == below(tiny_tokenizer(320), 318).encode("def f(x):").ids  # the same ids
