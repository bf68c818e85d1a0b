"""Every input failure a TurboError in one line (issue #33, class 6): text that is not text, a
non-path to turbo.open, options of the wrong type, train's argument values, and the argparse CLIs'
usage errors as one stderr line naming the argument and its choices, exit 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import turbo
from turbo.errors import TurboError
from turbo.repack import main as repack_main
from turbo.train.__main__ import main as train_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rt():
    return turbo.open("tiny", backend="cpu")


def one_line(exc: pytest.ExceptionInfo, *needles: str) -> str:
    message = str(exc.value)
    assert exc.type is TurboError and "\n" not in message, message
    for n in needles:
        assert n in message, message
    return message


@pytest.mark.parametrize("prompt, said", [("a\udcffb", "character 1 is a byte 0xff, not UTF-8"),
                                          ("ab\ud800", "character 2 is a lone surrogate U+D800")])
def test_text_that_is_not_text_is_refused(rt, prompt, said):
    with pytest.raises(TurboError) as e:
        rt.generate(prompt, max_new_tokens=2)
    assert one_line(e) == f"prompt: {said}: expected valid UTF-8 text"
    with pytest.raises(TurboError) as e:
        rt.chat([{"role": "user", "content": prompt}], template="{% for m in messages %}{{ m.content }}{% endfor %}")
    one_line(e, "chat prompt", said)


def test_a_byte_that_is_not_utf8_on_the_command_line_is_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "turbo", "threads=1", "backend=cpu", os.fsdecode(b"prompt=a\xffb")]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert p.returncode == 2
    assert p.stderr == "error: prompt: character 1 is a byte 0xff, not UTF-8: expected valid UTF-8 text\n"


@pytest.mark.parametrize("arg, kind", [(123, "int"), (None, "NoneType"), (b"tiny", "bytes")])
def test_open_refuses_what_is_not_a_path(arg, kind):
    with pytest.raises(TurboError) as e:
        turbo.open(arg)
    one_line(e, f"install of type {kind}: expected a directory")


def test_options_of_the_wrong_type(rt):
    with pytest.raises(TurboError) as e:
        rt.generate("hi", {"max_new_tokens": 2})
    one_line(e, "options of type dict: expected a GenerationOptions")
    with pytest.raises(TurboError) as e:
        list(rt.stream("hi", {"max_new_tokens": 2}))
    one_line(e, "options of type dict")
    with pytest.raises(TurboError) as e:
        turbo.open("tiny", {"backend": "cpu"})
    one_line(e, "options of type dict: expected an OpenOptions")


def usage_error(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


def test_repack_usage_errors_are_one_line(capsys, tmp_path):
    err = usage_error(repack_main, [str(tmp_path), str(tmp_path / "o"), "--quant", "int3"], capsys)
    assert err == ("error: argument --quant: invalid choice: 'int3' (choose from 'none', 'int4', 'int8', 'int2', "
                   "'int1') (see python -m turbo.repack --help)\n")
    assert "required: src, out" in usage_error(repack_main, [], capsys)


def test_train_usage_errors_are_one_line(capsys, tmp_path):
    err = usage_error(train_main, ["tiny", "--kind", "foo", "--out", str(tmp_path)], capsys)
    assert err == ("error: argument --kind: invalid choice: 'foo' (choose from 'dflash2', 'mtp', 'trunk') "
                   "(see python -m turbo.train --help)\n")
    assert "argument --lr: invalid float value: 'x'" in usage_error(
        train_main, ["tiny", "--kind", "mtp", "--out", str(tmp_path), "--lr", "x"], capsys)


@pytest.mark.parametrize("args, said", [
    (["--lr", "nan"], "--lr nan: expected a finite number above 0"),
    (["--lr", "0"], "--lr 0.0: expected a finite number above 0"),
    (["--gamma", "inf"], "--gamma inf: expected a finite number above 0"),
    (["--heads", "0"], "--heads 0: expected a positive integer"),
    (["--window", "-3"], "--window -3: expected a positive integer"),
])
def test_train_argument_values_are_refused_in_one_line(tmp_path, capsys, args, said):
    argv = ["tiny", "--kind", "dflash2", "--out", str(tmp_path / "out"), "--steps", "1", "--data", str(tmp_path), *args]
    assert train_main(argv) == 2
    assert capsys.readouterr().err == f"error: {said}\n"
    assert not (tmp_path / "out").exists()
