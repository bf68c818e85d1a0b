"""conf/config.yaml repeats the option sets' defaults (Hydra needs every key present): they agree."""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path

from omegaconf import OmegaConf

from turbo.config import GENERATION_KEYS, OPEN_KEYS, run_config
from turbo.drafters.ngram import NgramConfig
from turbo.sequence.options import GENERATION_FIELDS, OPEN_FIELDS, GenerationOptions, OpenOptions, Parallel

ROOT = Path(__file__).resolve().parents[1]


def test_the_cli_config_repeats_the_option_defaults():
    cfg = OmegaConf.load(ROOT / "conf" / "config.yaml")
    defaults = {f.name: f.default for f in fields(OpenOptions) + fields(GenerationOptions)}
    for key in OPEN_KEYS + GENERATION_KEYS:
        assert cfg[key] == defaults[key], key
    assert dict(cfg.ngram) == asdict(NgramConfig())
    # the two the CLI decides otherwise: null is the workload's max_new_tokens, and the CLI's
    # policy is auto (the API's None asks the environment first)
    assert cfg.max_new_tokens is None and cfg.policy.name == "auto"


def test_the_default_config_gives_the_default_options():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        rc = run_config(compose(config_name="config"))
    workload = OmegaConf.load(ROOT / "conf" / "workload" / "code.yaml")
    assert rc.generation == GenerationOptions(max_new_tokens=workload.max_new_tokens, policy="auto")
    assert rc.opening == OpenOptions.from_env()


def test_every_option_is_a_config_key():
    """Each GenerationOptions field is a key of conf/config.yaml (policy and ngram as their nodes),
    and each OpenOptions field but those the environment sets (OpenOptions.from_env)."""
    keys = set(OmegaConf.load(ROOT / "conf" / "config.yaml"))
    assert set(GENERATION_FIELDS) <= keys
    assert set(GENERATION_KEYS) == set(GENERATION_FIELDS) - {"max_new_tokens", "policy", "ngram"}
    from_env = {"native", "quant_cpu", "bf16_products", "cache_dir", "compiler", "ptx_dir", "draft_defaults"}
    # parallel: the `parallel:` node's keys (as ngram's), each a field of Parallel with its default
    assert set(OPEN_KEYS) == set(OPEN_FIELDS) - from_env - {"parallel"} and set(OPEN_KEYS) <= keys
    assert dict(OmegaConf.load(ROOT / "conf" / "config.yaml").parallel) == asdict(Parallel())
