"""Packaging (issue #47): a fresh `pip install -e '.[test]'` runs every test. Each package a test
module skips without (pytest.importorskip) is brought by an extra that `[test]` includes, and is
importable here; the only skips left are the ones no package cures: no GPU or CUDA driver, no Ray
(a cluster runtime: the `ray` extra, kept out of `[test]`), no llama.cpp build. A converter's or
the images' missing package is one line naming its extra."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest

from turbo.errors import TurboError

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
# module -> why a fresh `.[test]` install may still lack it (no extra of [test] is to bring it)
ALLOWED = {"ray": "Ray Serve: the `ray` extra, a cluster runtime outside [test]",
           "llama_cpp": "llama-cpp-python: a llama.cpp build, the benchmarks' reference"}
OUT_OF_TEST = {"ray", "test"}  # the extras [test] does not include (and itself)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement(spec: str) -> tuple[str, set[str]]:
    """(the distribution's name, the extras it asks for) of a requirement string."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", spec)
    assert m, spec
    return canonical(m.group(1)), {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}


def extras_of_test() -> tuple[set[str], set[str]]:
    """(turbo's extras [test] includes, the distributions it names), through turbo[...] itself."""
    extras, names, todo = set(), set(), ["test"]
    while todo:
        extra = todo.pop()
        extras.add(extra)
        for spec in EXTRAS[extra]:
            name, wanted = requirement(spec)
            if name == "turbo":
                todo += [e for e in wanted if e not in extras]
            else:
                names.add(name)
    return extras, names


def brought(names: set[str]) -> set[str]:
    """`names` and, as installed here, what they require unconditionally (their dependencies)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [requirement(r)[0] for r in requires if "extra ==" not in r.split(";", 1)[-1]]
    return seen


def skipped_modules() -> dict[str, list[str]]:
    """module -> the test files that pytest.importorskip it."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "importorskip" and node.args and isinstance(node.args[0], ast.Constant)):
                found.setdefault(node.args[0].value, []).append(path.name)
    return found


def test_every_extra_but_ray_is_in_test():
    extras, _ = extras_of_test()
    assert extras == set(EXTRAS) - (OUT_OF_TEST - {"test"}), sorted(set(EXTRAS) - extras)
    assert {"gguf", "vision"} <= extras


def test_no_test_module_skips_for_a_package_an_extra_brings():
    modules = skipped_modules()
    assert "gguf" in modules and "ray.serve" in modules  # (the scan finds what it is for)
    owners = md.packages_distributions()
    _, named = extras_of_test()
    cured = brought(named)
    wrong = []
    for module, files in sorted(modules.items()):
        top = module.split(".")[0]
        if top in ALLOWED:
            continue
        dists = {canonical(d) for d in owners.get(top, [])}
        if not dists & cured:
            wrong.append(f"{module} ({', '.join(files)}): no extra of [test] brings it" if dists else
                         f"{module} ({', '.join(files)}): not installed (pip install -e '.[test]' brings it?)")
            continue
        try:
            importlib.import_module(module)
        except ImportError as e:
            wrong.append(f"{module} ({', '.join(files)}): installed but not importable ({e})")
    assert not wrong, "\n".join(wrong)


def test_a_missing_gguf_names_its_extra(monkeypatch, tmp_path):
    from turbo.repack.gguf import _open

    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(TurboError) as e:
        _open(tmp_path / "model.gguf")
    assert str(e.value) == "gguf is not installed (reading GGUF checkpoints needs it): pip install 'turbo[gguf]'"


def test_a_missing_pillow_names_its_extra(monkeypatch):
    from turbo.vision.image import decode

    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(TurboError) as e:
        decode(b"\x89PNG")
    assert str(e.value) == "PIL.Image is not installed (decoding images needs it): pip install 'turbo[vision]'"
