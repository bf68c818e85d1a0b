"""The run configuration as Hydra composes it (conf/), read into the two option sets, which
check the values and hold the defaults (turbo/sequence/options.py)."""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import BinaryIO

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .drafters.ngram import NgramConfig
from .errors import TurboError
from .sequence.options import PARALLEL_AXES, GenerationOptions, OpenOptions, Parallel, check_n


@dataclass(frozen=True)
class ChatConfig:
    """task=chat's settings (turbo/chat_cli.py); null keys leave the template's defaults."""

    system: str | None = None  # the system prompt
    think: bool | None = None  # the template's enable_thinking; None: not passed
    template: str | None = None  # a .jinja file for an install without a template (or over its own)
    tools: str | None = None  # a JSON file: OpenAI's tools list the template offers
    tool_choice: str = "auto"  # none | auto | required | a tool's name


@dataclass(frozen=True)
class RunConfig:
    install: str
    opening: OpenOptions  # environment resolved (OpenOptions.from_env)
    generation: GenerationOptions
    prompt: str
    workload: str
    prompts: tuple[str, ...]
    task: str
    chat: ChatConfig = ChatConfig()
    images: tuple[str, ...] = ()  # task=generate's image= files (turbo/vision), in order
    n: int = 1  # task=generate's choices (Runtime.choices)



NGRAM_KEYS = tuple(f.name for f in fields(NgramConfig))


def _block(cfg: DictConfig, name: str, keys: tuple[str, ...]) -> dict:
    """A config block of named keys (conf/config.yaml's `ngram:`, `parallel:`) as a dict of its set
    values ({} where absent); a block that is not a mapping, or a key not among `keys`, is one line."""
    node = cfg.get(name)
    if node is None:
        return {}
    if not isinstance(node, DictConfig):
        raise TurboError(f"config: {name}={node!r}, expected a mapping of {', '.join(keys)}")
    unknown = [k for k in node if k not in keys]
    if unknown:
        raise TurboError(f"config: {name}.{unknown[0]} is not one of {', '.join(keys)}")
    return {str(k): v for k, v in node.items()}


def _ngram(cfg: DictConfig) -> NgramConfig:
    """The `ngram:` block; NgramConfig checks the values."""
    return NgramConfig(**_block(cfg, "ngram", NGRAM_KEYS))


def _parallel(cfg: DictConfig) -> Parallel:
    """The `parallel:` block; Parallel checks the values (a null one: its default)."""
    return Parallel(**{k: v for k, v in _block(cfg, "parallel", PARALLEL_AXES).items() if v is not None})


# the keys that set an option of the same name; null (or absent) leaves the option's default
OPEN_KEYS = ("backend", "dtype", "draft_products", "kv_cache", "threads", "verbose")
GENERATION_KEYS = ("block", "window", "rollback", "drafter", "temperature", "top_k", "top_p", "min_p", "seed",
                   "stop", "stop_token_ids", "stop_at_eos", "truncate_prompt", "repetition_penalty",
                   "frequency_penalty", "presence_penalty", "logit_bias", "response_format")
# names, kept as text even where one reads as a number
TEXT_KEYS = {"backend", "dtype", "draft_products", "kv_cache", "rollback", "drafter", "truncate_prompt"}


def _given(cfg: DictConfig, keys: tuple[str, ...]) -> dict[str, object]:
    """The keys' values the config sets, for the options to check (their defaults live there)."""
    values = ((key, cfg.get(key)) for key in keys)
    values = ((key, list(v) if isinstance(v, ListConfig) else v) for key, v in values)  # stop=[a,b]
    values = ((key, OmegaConf.to_container(v) if isinstance(v, DictConfig) else v)  # logit_bias={13: -100}
              for key, v in values)
    return {key: str(v) if key in TEXT_KEYS else v for key, v in values if v is not None}


THINK_VALUES = {True: True, False: False, "on": True, "off": False}


def _chat(cfg: DictConfig) -> ChatConfig:
    """The `system`, `think`, `chat_template`, `tools` and `tool_choice` keys (task=chat)."""
    system, think, template = cfg.get("system"), cfg.get("think"), cfg.get("chat_template")
    tools, tool_choice = cfg.get("tools"), cfg.get("tool_choice", "auto")
    if not isinstance(tool_choice, str):
        raise TurboError(f"config: tool_choice={tool_choice!r}, expected none, auto, required or a tool's name")
    if think is not None and (isinstance(think, (int, float)) and not isinstance(think, bool)
                              or think not in THINK_VALUES):
        raise TurboError(f"config: think={think!r}, expected true, false, on, off or null")
    return ChatConfig(system=str(system) if system is not None else None,
                      think=THINK_VALUES[think] if think is not None else None,
                      template=str(template) if template is not None else None,
                      tools=str(tools) if tools is not None else None, tool_choice=tool_choice)


def _images(cfg: DictConfig, task: str) -> tuple[str, ...]:
    """image=PATH or image=[A,B]: task=generate's images (each refused in one line when it is
    opened, turbo/vision/image.py)."""
    given = cfg.get("image")
    if given is None:
        return ()
    paths = tuple(str(p) for p in given) if isinstance(given, ListConfig) else (str(given),)
    if task != "generate" and paths:
        hint = "; in task=chat type /image PATH before a turn" if task == "chat" else ""
        raise TurboError(f"config: image= goes with task=generate, not task={task}{hint}")
    return paths


def _text(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TurboError(f"{where}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None


def _prompt(cfg: DictConfig, prompts: tuple[str, ...], stdin: BinaryIO | None) -> str:
    """prompt= (`-`: standard input, read to its end), prompt_file= (the file's text), else the
    workload's first prompt. prompt= and prompt_file= together are refused: neither silently wins."""
    try:
        given, path = cfg.get("prompt"), cfg.get("prompt_file")
    except OmegaConfBaseException as e:  # `${...}` in the text is an interpolation to the config
        raise TurboError(f"config: {str(e).splitlines()[0]} (a literal ${{ is \\${{; or use prompt_file= or "
                         "prompt=-)") from None
    if given is not None and path is not None:
        raise TurboError("config: prompt= and prompt_file= are both given; give one")
    if path is not None:
        try:
            data = Path(str(path)).expanduser().read_bytes()
        except OSError as e:
            raise TurboError(f"prompt_file={path}: {e.strerror or e}") from None
        return _text(data, f"prompt_file={path}")
    if given is None:
        if not prompts:
            raise TurboError(f"config: workload {cfg.workload.get('name')!r} has no prompts and no prompt= or "
                             "prompt_file= was given")
        return prompts[0]
    if str(given) != "-":
        return str(given)
    if str(cfg.task.name) == "chat":
        raise TurboError("config: prompt=- reads standard input, where task=chat reads the conversation")
    return _text((stdin or sys.stdin.buffer).read(), "prompt=- (standard input)")


def _install(group: DictConfig) -> str:
    """install=NAME opens a shipped install by name; install.path=DIR a directory, always as a
    path (made one with ./ when bare, turbo.open would otherwise take "tiny" for the name)."""
    path = group.get("path")
    if path is None:
        return str(group.name)
    return str(path) if "/" in str(path) else f"./{path}"


def run_config(cfg: DictConfig, stdin: BinaryIO | None = None) -> RunConfig:
    """`stdin` (default sys.stdin's bytes) is read only for prompt=-."""
    try:
        install = _install(cfg.install)
        workload = cfg.workload
        prompts = tuple(str(p) for p in workload.prompts)
        task = cfg.task.name
    except Exception as e:  # omegaconf raises several kinds for absent keys
        raise TurboError(f"config: {e}".splitlines()[0]) from None
    policy = cfg.get("policy")
    name = policy.get("name") if isinstance(policy, DictConfig) else policy
    max_new = cfg.get("max_new_tokens")
    opening = OpenOptions.from_env(**_given(cfg, OPEN_KEYS), parallel=_parallel(cfg))
    generation = GenerationOptions(
        max_new_tokens=max_new if max_new is not None else workload.max_new_tokens, policy=str(name),
        ngram=_ngram(cfg), **_given(cfg, GENERATION_KEYS))
    chat, images = _chat(cfg), _images(cfg, str(task))
    n = check_n(cfg.get("n", 1))
    return RunConfig(install=str(install), opening=opening, generation=generation,
                     prompt=_prompt(cfg, prompts, stdin),  # last: every other refusal comes before stdin is read
                     workload=str(workload.get("name", "")), prompts=prompts, task=str(task), chat=chat,
                     images=images, n=n)


def known_keys(conf_dir: str) -> set[str]:
    """Every key the config can have, dotted: conf/config.yaml's own and each group option's at
    its package (the group's name, or the root under `# @package _global_`). Hydra's are not in it."""

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            if prefix or key not in ("defaults", "hydra"):
                keys.add(prefix + str(key))
                if isinstance(value, DictConfig):
                    walk(value, f"{prefix}{key}.")

    keys: set[str] = set()
    root = Path(conf_dir)
    walk(OmegaConf.load(root / "config.yaml"), "")
    for path in root.glob("*/*.yaml"):
        if path.parent.name != "hydra":
            group = "" if path.read_text().startswith("# @package _global_") else path.parent.name
            keys.add(group)
            walk(OmegaConf.load(path), f"{group}." if group else "")
    keys.discard("")
    return keys


def unknown_key(conf_dir: str, overrides: list[str]) -> str | None:
    """The first override setting a key the config does not have -- with `+` too: the config is
    closed, so `+blok=4` is a typo, not a new setting -- as one line naming the nearest known key.
    Group selections (`+policy=fixed`, `workload=code`) and hydra.* are Hydra's to check."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:  # a malformed override: composing it reports that
        return None
    known = None
    for o in parsed:
        key = o.key_or_group
        if key.split(".")[0].split("/")[0] == "hydra" or Path(conf_dir, key).is_dir():
            continue
        known = known if known is not None else known_keys(conf_dir)
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"nearest: {near[0]}" if near else \
                "expected one of " + ", ".join(sorted(k for k in known if "." not in k))
            return f"config key {key!r} is not known ({hint})"
    return None
