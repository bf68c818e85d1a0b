"""Malformed files end in one TurboError line, never accepted silently; repack faults leave nothing behind."""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import turbo
from turbo.errors import TurboError
from turbo.repack import repack
from turbo.repack import tensors as repack_mod
from turbo.store.install import open_install
from turbo.store.safetensors_format import read_header
from turbo.testing import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
T = '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'


def library_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), "pt"):
            return True
    except Exception:  # the library raises its own SafetensorError (and others) for a bad file
        return False


def turbo_accepts(path: Path) -> bool:
    try:
        read_header(path)
        return True
    except TurboError as e:
        assert "\n" not in str(e) and str(path) in str(e)
        return False


def write(path: Path, header: str | bytes, data: bytes = b"\0" * 8, length: int | None = None) -> Path:
    raw = header.encode() if isinstance(header, str) else header
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def nested(depth: int) -> str:
    return '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":' + "[" * depth + "]" * depth + "}}"


# (header, data, header-length override), each judged by the library and by us alike
CASES = {
    "valid": ("{" + T + "}", None, None),
    "padded": ("{" + T + "}   ", None, None),
    "leading space": (" {" + T + "}", None, None),
    "unknown field": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":{"y":[1,-2,1e5]}}}', None, None),
    "array entry": ('{"a":["F32",[2],[0,8]]}', None, None),
    "metadata null": ('{"__metadata__":null,' + T + "}", None, None),
    "empty": ("{}", b"", None),
    "zero dims": ('{"a":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]}}', b"", None),
    "scalar": ('{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}', b"\0" * 4, None),
    "nested 125": (nested(125), None, None),
    "nested 126": (nested(126), None, None),
    "nested 5000": (nested(5000), None, None),
    "length one short": ("{" + T + "} ", None, len("{" + T + "} ") - 1),
    "length two short": ("{" + T + "}  ", None, len("{" + T + "}  ") - 2),
    "length one long": ("{" + T + "}", None, len("{" + T + "}") + 1),
    "length past end": ("{" + T + "}", None, 10_000),
    "length huge": ("{" + T + "}", None, 2**63),
    "trailing bytes": ("{" + T + "}", b"\0" * 9, None),
    "truncated": ("{" + T + "}", b"\0" * 7, None),
    "gap": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[5,9]}}',
            b"\0" * 9, None),
    "overlap": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
                None, None),
    "shifted": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', b"\0" * 12, None),
    "unsorted but tiling": ('{"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},"a":{"dtype":"F32","shape":[1],'
                            '"data_offsets":[0,4]}}', None, None),
    "size mismatch": ('{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', None, None),
    "end before begin": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}', None, None),
    "duplicate field": ('{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', None, None),
    "duplicate metadata": ('{"__metadata__":{},"__metadata__":{},' + T + "}", None, None),
    "offset string": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":["0",8]}}', None, None),
    "offset float": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}}', None, None),
    "offset null": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":null}}', None, None),
    "offset minus zero": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]}}', None, None),
    "offsets three": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}', None, None),
    "shape bool": ('{"a":{"dtype":"F32","shape":[true,2],"data_offsets":[0,8]}}', None, None),
    "shape string": ('{"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}}', None, None),
    "shape 2^64": ('{"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,8]}}', None, None),
    "shape overflow": ('{"a":{"dtype":"F32","shape":[18446744073709551615,2],"data_offsets":[0,8]}}', None, None),
    "huge literal": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":' + "9" * 5000 + "}}", None, None),
    "dtype list": ('{"a":{"dtype":["F32"],"shape":[2],"data_offsets":[0,8]}}', None, None),
    "dtype unknown": ('{"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}}', None, None),
    "sub-byte": ('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', b"\0\0", None),
    "missing field": ('{"a":{"dtype":"F32","data_offsets":[0,8]}}', None, None),
    "entry null": ('{"a":null}', None, None),
    "metadata list": ('{"__metadata__":[],' + T + "}", None, None),
    "metadata int value": ('{"__metadata__":{"k":1},' + T + "}", None, None),
    "top list": ("[]", None, None),
    "nan": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":NaN}}', None, None),
    "lone surrogate": ('{"a\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', None, None),
    "not utf-8": (b'{"a\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', None, None),
    "not json": ("{" + T, None, None),
}


@pytest.mark.parametrize("case", CASES)
def test_headers_are_judged_as_the_library_judges_them(tmp_path, case):
    header, data, length = CASES[case]
    path = write(tmp_path / "x.safetensors", header, b"\0" * 8 if data is None else data, length)
    assert turbo_accepts(path) == library_accepts(path)


@pytest.mark.parametrize("header", ["{" + T + "," + T + "}", '{"__metadata__":{"k":"1","k":"2"},' + T + "}"])
def test_a_name_given_twice_is_refused_where_the_library_keeps_the_last(tmp_path, header):
    path = write(tmp_path / "x.safetensors", header)
    assert library_accepts(path)
    with pytest.raises(TurboError, match="twice"):
        read_header(path)


def test_the_index_is_a_view_of_the_header(tmp_path):
    path = write(tmp_path / "x.safetensors", '{"__metadata__":{"k":"v"},' + T + "}")
    h = read_header(path)
    assert h.metadata == {"k": "v"} and h.data_start == path.stat().st_size - 8
    assert (h.tensors["a"].dtype, h.tensors["a"].shape, h.tensors["a"].begin, h.tensors["a"].end) == ("F32", (2,), 0, 8)


# ---- installs ---------------------------------------------------------------------------------


@pytest.fixture
def install(tmp_path, spec_install):
    dst = tmp_path / "inst"
    shutil.copytree(spec_install[1], dst)
    return dst


def edit_tensors(path: Path, edit) -> None:
    with safe_open(str(path), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    edit(t)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path), metadata=meta)


def one_line_refusal(install: Path, needle: str) -> str:
    """Refused by turbo.open, or (where the drafter is built on first use) by the first generation."""
    with pytest.raises(TurboError) as e:
        turbo.open(install, backend="cpu").generate([5, 6, 7], max_new_tokens=2)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg, msg
    return msg


def test_header_one_byte_short_is_refused(install):
    path = install / "model.safetensors"
    blob = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", blob[:8])
    blob[:8] = struct.pack("<Q", n - 1)
    path.write_bytes(bytes(blob))
    assert not library_accepts(path)
    one_line_refusal(install, str(path))


def test_duplicate_key_in_an_install_is_refused(install):
    path = install / "model.safetensors"
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = blob[8:8 + n].decode().rstrip()
    first = json.loads(header)
    name = next(k for k in first if k != "__metadata__")
    doubled = header[:-1] + "," + json.dumps(name) + ":" + json.dumps(first[name]) + "}"
    doubled += " " * (-len(doubled) % 8)
    path.write_bytes(struct.pack("<Q", len(doubled)) + doubled.encode() + blob[8 + n:])
    one_line_refusal(install, f"{name!r} is listed twice")


def test_a_trunk_tensor_in_the_drafter_file_is_refused_by_name(install):
    path = install / "dflash" / "model.safetensors"
    edit_tensors(path, lambda t: t.__setitem__("trunk.norm.weight", torch.zeros(64)))
    assert library_accepts(path)
    one_line_refusal(install, f"{path}: tensor trunk.norm.weight does not belong in this file")


def test_a_tensor_in_two_trunk_files_is_refused(install):
    save_file({"trunk.norm.weight": torch.zeros(64)}, str(install / "more.safetensors"))
    one_line_refusal(install, "tensor trunk.norm.weight is also in")


def test_zero_dim_drafter_tensor_is_refused_at_open(install):
    path = install / "dflash" / "model.safetensors"
    edit_tensors(path, lambda t: t.__setitem__("dflash.hidden_norm.weight", torch.zeros(0)))
    assert library_accepts(path) and read_header(path).tensors["dflash.hidden_norm.weight"].shape == (0,)
    one_line_refusal(install, "dflash.hidden_norm.weight")


def test_integer_bytes_where_a_float_weight_belongs_are_refused(install):
    path = install / "model.safetensors"
    edit_tensors(path, lambda t: t.__setitem__("trunk.norm.weight", t["trunk.norm.weight"].view(torch.int32)))
    one_line_refusal(install, "trunk.norm.weight: stored as I32, expected one of BF16, F16, F32")


# ---- repack faults ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    src = tmp_path_factory.mktemp("ckpt") / "hf"
    make_checkpoint(src, 0)
    return src


# A repack that stops mid-write (after its first tensor) until a signal comes.
STALLED = """
import sys, time
import turbo.repack as r
import turbo.repack.tensors as t
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)  # (as in a terminal: a background job ignores it)
copier = t._copier
def stalled(*a):
    write = copier(*a)
    def slow(out):
        write(out)
        print("writing", flush=True)
        time.sleep(60)
    return slow
t._copier = stalled
sys.exit(r.main([sys.argv[1], sys.argv[2], "--quiet"]))
"""


def stalled_repack(src: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", STALLED, str(src), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "writing\n"
    return proc


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_repack_prints_one_line_and_removes_its_temporary(tmp_path, checkpoint, sig, status):
    out = tmp_path / "inst"
    proc = stalled_repack(checkpoint, out)
    assert len(siblings(out)) == 1  # the temporary sibling, mid-write
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status and err == "interrupted\n"
    assert list(tmp_path.iterdir()) == []


def test_a_killed_repack_leaves_a_temporary_the_next_one_removes(tmp_path, checkpoint, capfd):
    out = tmp_path / "inst"
    proc = stalled_repack(checkpoint, out)
    proc.kill()
    proc.wait(timeout=60)
    (stale,) = siblings(out)
    repack(checkpoint, out, quiet=True)
    assert f"removed {tmp_path / stale}" in capfd.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["inst"]
    assert open_install(out).index.has_prefix("trunk.")


def run_repack_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "turbo.repack", *args, "--quiet"], capture_output=True, text=True,
                          env=env, timeout=300)


def test_output_whose_parent_is_a_file_is_one_line_exit_2(tmp_path, checkpoint):
    (tmp_path / "file").write_text("x")
    r = run_repack_cli(str(checkpoint), str(tmp_path / "file" / "inst"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr == f"error: {tmp_path / 'file'}: not a directory (expected one to write the install inst into)\n"


def test_read_only_output_is_one_line_exit_2(checkpoint):
    # /sys is read-only for every user, root included (a chmod'ed directory is not, for root)
    r = run_repack_cli(str(checkpoint), "/sys/turbo-repack-test")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "/sys" in r.stderr and "cannot create" in r.stderr
    assert not Path("/sys/turbo-repack-test").exists()


def test_disk_full_is_one_line_and_leaves_nothing(tmp_path, checkpoint, monkeypatch):
    def full(*a):
        def write(out):
            raise OSError(28, "No space left on device")
        return write

    monkeypatch.setattr(repack_mod, "_copier", full)
    with pytest.raises(TurboError, match=r"inst: cannot write the install \(No space left on device\)"):
        repack(checkpoint, tmp_path / "inst", quiet=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_install_permissions_follow_the_umask(tmp_path, checkpoint, umask):
    old = os.umask(umask)
    try:
        out = repack(checkpoint, tmp_path / "inst", quiet=True)
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_drafter_of_another_width_is_refused_before_writing(tmp_path, checkpoint):
    from turbo.testing import make_drafter

    drafter = make_drafter(tmp_path / "drafter", 32, 320, [0, 2])
    with pytest.raises(TurboError, match="hidden_size is 32, expected the trunk's 64"):
        repack(checkpoint, tmp_path / "inst", drafter=drafter, quiet=True)
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    with pytest.raises(TurboError, match=r"fc.weight has shape \[32, 64\], expected 64 rows"):
        repack(checkpoint, tmp_path / "inst", drafter=drafter, quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_a_sparse_file_declaring_a_64_gb_tensor_is_refused_before_reading(install):
    """Its header is sound (the file really is 64 GB, sparse): the bound for one tensor refuses
    it at open, before a byte of it is mapped or allocated."""
    import resource

    n = 2 ** 35  # bf16 elements: 64 GiB
    header = json.dumps({"trunk.huge": {"dtype": "BF16", "shape": [2 ** 20, 2 ** 15], "data_offsets": [0, 2 * n]}})
    header += " " * (-len(header) % 8)
    path = install / "huge.safetensors"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.truncate(8 + len(header) + 2 * n)
    assert read_header(path).tensors["trunk.huge"].shape == (2 ** 20, 2 ** 15)  # the format itself accepts it
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    msg = one_line_refusal(install, f"{path}: tensor trunk.huge declares {n} elements [1048576, 32768], "
                                    "over turbo's bound of 2^34 for one tensor")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024, msg  # KiB


def test_a_separate_lm_head_under_tied_embeddings_is_refused(install):
    config = json.loads((install / "config.json").read_text())
    assert not config["tie_word_embeddings"]
    (install / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    one_line_refusal(install, "trunk.lm_head.weight: a separate lm_head, but the config's tie_word_embeddings is true")
