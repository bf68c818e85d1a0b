"""python -m turbo as a user runs it: the continuation alone on stdout and a stats line on stderr on
success; one line and exit 2 on a user error."""

import json
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file


def run(tmp_path, *overrides):
    cmd = [sys.executable, "-m", "turbo", f"hydra.run.dir={tmp_path}/hydra", "threads=1", "backend=cpu", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)


def one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def rewrite(install, transform):
    path = install / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(transform(tensors), str(path))


@pytest.fixture
def copy(plain_install, tmp_path):
    dst = tmp_path / "inst"
    shutil.copytree(plain_install[1], dst)
    return dst


def test_generate_streams_text_and_ends_with_stats_line(plain_install, tmp_path):
    proc = run(tmp_path, f"install.path={plain_install[1]}", "prompt=hello", "max_new_tokens=8")
    assert proc.returncode == 0, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "[stats]" not in proc.stdout
    for field in ("prompt", "generated 8 tok", "ttft", "prefill", "decode"):
        assert field in last
    assert "no DFlash2 drafter" in proc.stderr  # auto says once why it is not speculating


def test_speculative_stats_line(spec_install, tmp_path):
    proc = run(tmp_path, f"install.path={spec_install[1]}", "prompt=hello", "max_new_tokens=9", "+policy=fixed",
               "block=3", "rollback=replay")
    assert proc.returncode == 0, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    for field in ("dflash block 3", "rounds", "accepted/round", "mean acceptance length", "rollback rate",
                  "replayed rows", "per-position"):
        assert field in last


def test_ngram_drafter_speculates_on_an_install_without_one(plain_install, tmp_path):
    proc = run(tmp_path, f"install.path={plain_install[1]}", "prompt=" + "a b c d e f " * 8, "max_new_tokens=16",
               "drafter=ngram", "+policy=fixed", "block=4")
    assert proc.returncode == 0, proc.stderr
    assert "ngram block 4" in proc.stderr.strip().splitlines()[-1]


def test_stdout_holds_the_continuation_alone(plain_install, tmp_path):
    """`python -m turbo prompt=- < in.txt > out.txt`: out.txt is the continuation, byte for byte
    the API's text (no prompt, no stats, no trailing newline); the reports are on stderr."""
    import turbo

    (tmp_path / "in.txt").write_text("def fib(n):\n")
    cmd = [sys.executable, "-m", "turbo", "threads=1", "backend=cpu", f"install.path={plain_install[1]}", "prompt=-",
           "max_new_tokens=12"]
    with open(tmp_path / "in.txt") as stdin, open(tmp_path / "out.txt", "w") as stdout:
        proc = subprocess.run(cmd, stdin=stdin, stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                              timeout=120)
    assert proc.returncode == 0, proc.stderr
    want = turbo.open(plain_install[1], backend="cpu").generate("def fib(n):\n", max_new_tokens=12).text
    assert want and (tmp_path / "out.txt").read_text() == want
    assert proc.stderr.strip().splitlines()[-1].startswith("[stats] prompt")


def test_missing_install(tmp_path):
    one_line_error(run(tmp_path, f"install.path={tmp_path}/nowhere"), "nowhere", "no such directory")


def test_missing_config(copy, tmp_path):
    (copy / "config.json").unlink()
    one_line_error(run(tmp_path, f"install.path={copy}"), "config.json", "missing")


def test_unknown_model_type(copy, tmp_path):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["model_type"] = "llama"
    (copy / "config.json").write_text(json.dumps(cfg))
    one_line_error(run(tmp_path, f"install.path={copy}"), "'llama'", "expected one of")


def test_missing_tensor(copy, tmp_path):
    rewrite(copy, lambda t: {k: v for k, v in t.items() if k != "trunk.layers.1.mlp.up_proj.weight"})
    one_line_error(run(tmp_path, f"install.path={copy}"), "trunk.layers.1.mlp.up_proj.weight", "missing")


def test_wrong_shape(copy, tmp_path):
    def bad(t):
        t["trunk.layers.3.self_attn.o_proj.weight"] = torch.zeros(64, 32)
        return t
    rewrite(copy, bad)
    one_line_error(run(tmp_path, f"install.path={copy}"), "trunk.layers.3.self_attn.o_proj.weight",
                   "[64, 32]", "expected [64, 64]")


def test_truncated_safetensors(copy, tmp_path):
    path = copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    one_line_error(run(tmp_path, f"install.path={copy}"), "model.safetensors", "truncated")


def test_empty_prompt(plain_install, tmp_path):
    one_line_error(run(tmp_path, f"install.path={plain_install[1]}", "prompt=''"), "prompt is empty")


def test_over_long_prompt(plain_install, tmp_path):
    one_line_error(run(tmp_path, f"install.path={plain_install[1]}", "prompt=hello", "max_new_tokens=5000"),
                   "max_position_embeddings 4096")


def test_fixed_policy_without_drafter_is_refused(plain_install, tmp_path):
    one_line_error(run(tmp_path, f"install.path={plain_install[1]}", "prompt=hi", "+policy=fixed", "block=2"),
                   "no DFlash2 drafter", "dflash.fc.weight")


def test_block_outside_trained_range(spec_install, tmp_path):
    one_line_error(run(tmp_path, f"install.path={spec_install[1]}", "prompt=hi", "+policy=fixed", "block=9"),
                   "block 9", "8")
    one_line_error(run(tmp_path, f"install.path={spec_install[1]}", "prompt=hi", "+policy=fixed", "block=0"),
                   "block 0", "1..8")


def test_window_out_of_range(spec_install, tmp_path):
    one_line_error(run(tmp_path, f"install.path={spec_install[1]}", "prompt=hi", "window=0"), "window 0")
    one_line_error(run(tmp_path, f"install.path={spec_install[1]}", "prompt=hi", "window=65"), "window 65", "64")


def test_unknown_draft_products(spec_install, tmp_path):
    one_line_error(run(tmp_path, f"install.path={spec_install[1]}", "prompt=hi", "draft_products=int4"),
                   "draft_products 'int4'", "auto, fp32, bf16, int8")


def test_bad_overrides_are_one_line(tmp_path):
    one_line_error(run(tmp_path, "workload=poetry"), "workload/poetry", "code edit math prose")
    one_line_error(run(tmp_path, "nosuchkey=1"), "nosuchkey")
    one_line_error(run(tmp_path, "block=abc", "+policy=fixed"), "block")


def test_a_missing_sweep_launcher_is_one_line(monkeypatch):
    import importlib.util

    from turbo.__main__ import launcher_missing

    assert launcher_missing(["hydra/launcher=joblib", "task=probe"]) is None  # installed here (the sweeps extra)
    assert launcher_missing(["hydra/launcher=basic"]) is None  # Hydra's own
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    for launcher, plugin in [("local", "hydra-joblib-launcher"), ("submitit_local", "hydra-submitit-launcher")]:
        line = launcher_missing(["-m", f"hydra/launcher={launcher}"])
        assert plugin in line and "pip install 'turbo[sweeps]'" in line


@pytest.mark.parametrize("threads", ["100000", "-1"])
def test_threads_outside_the_machine_are_one_line(plain_install, tmp_path, threads):
    proc = run(tmp_path, f"install.path={plain_install[1]}", "prompt=hi", f"threads={threads}")
    one_line_error(proc, f"threads {threads} is outside 1..", "cores")


def test_unknown_keys_are_refused_with_plus_too(tmp_path):
    one_line_error(run(tmp_path, "+blok=4"), "config key 'blok' is not known", "nearest: block")
    one_line_error(run(tmp_path, "task=probe", "++probe.blok=[1]"), "'probe.blok'", "nearest: probe.blocks")


def test_a_probe_refusal_is_one_line(spec_install, tmp_path):
    one_line_error(run(tmp_path, f"install.path={spec_install[1]}", "task=probe", "probe.blocks=[0]"),
                   "block 0 is outside 1..8")


def test_an_output_dir_under_a_file(spec_install, tmp_path):
    (tmp_path / "afile").write_text("")
    where = f"hydra.run.dir={tmp_path}/afile/out"
    cmd = [sys.executable, "-m", "turbo", "threads=1", "backend=cpu", f"install.path={spec_install[1]}"]
    probe = subprocess.run(cmd + ["task=probe", where], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    one_line_error(probe, f"{tmp_path}/afile is not a directory")
    # generate writes nothing: Hydra's output directory is not needed at all
    gen = subprocess.run(cmd + ["prompt=hi", "max_new_tokens=4", where], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert gen.returncode == 0 and "generated 4 tok" in gen.stderr, gen.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_ctrl_c_ends_with_the_stats_line_and_exit_130(plain_install, tmp_path):
    cmd = [sys.executable, "-m", "turbo", "threads=1", "backend=cpu", f"install.path={plain_install[1]}",
           "prompt=hello", "max_new_tokens=2000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    assert proc.stdout.read(1)  # the first token: the decode is under way
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1] == "interrupted", err
    assert lines[-2].startswith("[stats] prompt") and "generated 2000 tok" not in lines[-2] and "[stats]" not in out


def test_unknown_kv_cache(tmp_path):
    one_line_error(run(tmp_path, "prompt=hi", "kv_cache=float16"), "kv_cache 'float16'", "auto, float32, bfloat16")
