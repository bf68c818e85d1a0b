"""The two option sets: how a runtime is opened, and how one generation runs.

They are the one place these fields are defined, defaulted and checked (a value that needs
the install or the drafter to judge is the engine's to check): the CLI builds them from the
Hydra config (turbo.config; conf/config.yaml repeats these defaults for Hydra, and
tests/test_options.py holds the two equal), the TUI and the probe from the same, the API from
keyword arguments. Environment variables are read here and nowhere else
(`OpenOptions.from_env`, `policy_from_env`), at the edges that build the options.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from ..drafters import is_drafter
from ..drafters.ngram import NgramConfig
from ..errors import TurboError, ascii_decimal, json_shown
from ..store.quant import QUANT_CPU_ENV
from .grammar import ResponseFormat
from .logprobs import MAX_TOP
from .penalties import BIAS_RANGE, PENALTY_RANGE, Penalties

NATIVE_ENV = "TURBO_NATIVE"  # "0": the torch step instead of native.c
CACHE_ENV = "TURBO_CACHE"  # where native.c's build is cached
COMPILER_ENV = "CC"  # the C compiler native.c is built with (the toolchain's own convention, as make reads it)
BF16_PRODUCTS_ENV = "TURBO_BF16_PRODUCTS"  # "exact": the native step's bf16 products without AMX (fp32 walk)
BF16_PRODUCTS = ("auto", "exact")  # OpenOptions.bf16_products
PTX_DIR_ENV = "TURBO_PTX_DIR"  # where backend cuda reads its PTX (default: the checkout's kernels_ptx/)
KV_CACHES = ("auto", "float32", "bfloat16")  # OpenOptions.kv_cache
DTYPES = ("float32", "bfloat16")  # OpenOptions.dtype
ROLLBACKS = ("checkpoint", "replay")  # GenerationOptions.rollback
TRUNCATIONS = ("none", "left")  # GenerationOptions.truncate_prompt
OWN_DRAFTERS = ("auto", "dflash", "mtp")  # served by the install's own weights (turbo.sequence.policy.DRAFTERS adds ngram)
POLICY_ENVS = {"dflash": "TURBO_DFLASH_DRAFT", "mtp": "TURBO_MTP_DRAFT"}


PARALLEL_AXES = ("pipeline", "tensor", "experts")  # Parallel's fields, the config's parallel.* keys


@dataclass(frozen=True)
class Parallel:
    """How one model is split over processes (turbo/parallel): `pipeline` stages of contiguous
    layers, `tensor` ranks per stage splitting each product by its outputs, `experts` ranks
    sharing an MoE layer's routed experts. The world is their product (each axis its own ranks);
    1 x 1 x 1 is the single process. What the model can take is checked at open
    (turbo/parallel/plan.py), before any rank loads a weight."""

    pipeline: int = 1
    tensor: int = 1
    experts: int = 1

    def __post_init__(self) -> None:
        for name in PARALLEL_AXES:
            value = getattr(self, name)
            n = integer(value)
            if n is None or n < 1 or n > 4096:
                raise TurboError(f"parallel.{name} is {value!r}, expected an integer in 1..4096",
                                 field=f"parallel.{name}")
            object.__setattr__(self, name, n)

    @property
    def world(self) -> int:
        """The processes the model runs on."""
        return self.pipeline * self.tensor * self.experts

    @classmethod
    def of(cls, value: object) -> "Parallel":
        """A Parallel, or a mapping of its fields (the config's `parallel:` node, a keyword's dict)."""
        if isinstance(value, Parallel):
            return value
        if isinstance(value, Mapping):
            unknown = [k for k in value if k not in PARALLEL_AXES]
            if unknown:
                raise TurboError(f"parallel.{unknown[0]} is not one of {', '.join(PARALLEL_AXES)}",
                                 field="parallel")
            return cls(**{str(k): v for k, v in value.items() if v is not None})
        raise TurboError(f"parallel of type {type(value).__name__}: expected a turbo Parallel or a mapping of "
                         f"{', '.join(PARALLEL_AXES)}", field="parallel")


@dataclass(frozen=True)
class OpenOptions:
    """How `turbo.open` builds a runtime."""

    backend: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16: the activations' dtype
    draft_products: str = "auto"  # auto | fp32 | bf16 | int8: the CPU drafters' matrix products
    threads: int | None = None  # torch's intra-op threads (None: leave as is)
    native: bool = True  # False: the torch step even where native.c builds (TURBO_NATIVE=0)
    quant_cpu: str = "auto"  # TURBO_QUANT_CPU: auto | kernel | packed | dequant | native (turbo.store.quant)
    # TURBO_BF16_PRODUCTS: auto | exact. The native step's bf16 matrices: auto takes AMX-BF16 where the
    # CPU has it (inputs rounded to bf16, every row count alike), exact the fp32 walk of widened
    # weights; one choice per process (native_amx.c, bf16_products): None takes the process's
    # (auto unless a runtime opened before chose), a named one that differs from it is refused
    bf16_products: str | None = None
    kv_cache: str = "auto"  # auto | float32 | bfloat16: the attention layers' K/V cache (auto: turbo.load.loader.kv_dtype)
    cache_dir: Path | None = None  # native.c's build cache (TURBO_CACHE; None: XDG / ~/.cache)
    compiler: str | None = None  # native.c's C compiler (CC; None: cc, gcc or clang on PATH)
    ptx_dir: Path | None = None  # backend cuda's PTX (TURBO_PTX_DIR; None: kernels_ptx/ of the checkout)
    verbose: bool = False  # the CLI and the TUI say what auto chose (the backend's note)
    # (drafter, policy, block): what a generation that names no policy takes (TURBO_DFLASH_DRAFT,
    # TURBO_MTP_DRAFT: policy_from_env); none given: auto
    draft_defaults: tuple[tuple[str, str, int | None], ...] = ()
    # one model over several processes (turbo/parallel): the config's parallel.pipeline / tensor / experts
    parallel: Parallel = field(default_factory=lambda: Parallel())  # (integer() is defined below)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parallel", Parallel.of(self.parallel))  # (a dict from a keyword or the config)
        check_threads(self.threads)
        check_flag("verbose", self.verbose)
        if self.dtype not in DTYPES:
            raise TurboError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}", field="dtype")
        if self.bf16_products is not None and self.bf16_products not in BF16_PRODUCTS:
            raise TurboError(f"bf16_products {self.bf16_products!r} is not one of {', '.join(BF16_PRODUCTS)}",
                             field="bf16_products")
        if self.kv_cache not in KV_CACHES:
            raise TurboError(f"kv_cache {self.kv_cache!r} is not one of {', '.join(KV_CACHES)}", field="kv_cache")

    @classmethod
    def from_env(cls, **given) -> "OpenOptions":
        """The options with the environment's say on the fields a caller did not give."""
        env = {}
        if "native" not in given:
            env["native"] = os.environ.get(NATIVE_ENV, "1").strip() != "0"
        if "quant_cpu" not in given:
            env["quant_cpu"] = os.environ.get(QUANT_CPU_ENV, "auto").strip() or "auto"
        if "bf16_products" not in given:
            env["bf16_products"] = os.environ.get(BF16_PRODUCTS_ENV, "").strip() or None
        if "cache_dir" not in given:
            root = os.environ.get(CACHE_ENV) or os.environ.get("XDG_CACHE_HOME")
            env["cache_dir"] = Path(root) / "turbo" if root else None
        if "compiler" not in given:
            env["compiler"] = os.environ.get(COMPILER_ENV) or None
        if "draft_defaults" not in given:
            env["draft_defaults"] = tuple((kind, *policy_from_env(kind)) for kind in POLICY_ENVS)
        if "ptx_dir" not in given:
            env["ptx_dir"] = Path(os.environ[PTX_DIR_ENV]) if os.environ.get(PTX_DIR_ENV) else None
        return cls(**env, **given)

    def but(self, **changes) -> "OpenOptions":
        return replace(self, **changes)


# as_integer's: the GenerationOptions fields that count
INTEGER_FIELDS = ("max_new_tokens", "block", "window", "top_k", "seed")


@dataclass(frozen=True)
class GenerationOptions:
    """How one `generate` / `stream` call runs."""

    max_new_tokens: int = 256
    policy: str | None = None  # auto | off | fixed | adaptive; None: OpenOptions.draft_defaults' (the env's), else auto
    block: int | None = None  # proposals per round (fixed; the widest for adaptive)
    rollback: str = "checkpoint"  # checkpoint | replay: how a rejected round restores the GDN state
    drafter: object = "auto"  # auto | dflash | mtp | ngram, or a Drafter object of the caller's (turbo.drafters)
    window: int | None = None  # the DFlash drafter's context window (None: its trained sliding_window)
    stop_at_eos: bool = True  # stop at the model's end-of-text token
    # none: a prompt that leaves no room for max_new_tokens is refused; left: its tail is kept
    truncate_prompt: str = "none"
    # turbo.sequence.stops: text that ends the generation (not emitted), and token ids that do as eos does
    stop: tuple[str, ...] | None = None  # a str or a list/tuple of non-empty strings
    stop_token_ids: tuple[int, ...] | None = None  # ids in the vocabulary (checked when a stream starts)
    ngram: NgramConfig = NgramConfig()  # drafter=ngram's matching (turbo/drafters/ngram.py)
    # sampling (turbo.sequence.sampling): temperature 0 is greedy and ignores the rest
    temperature: float = 0.0
    top_k: int | None = None  # None or 0: no top-k cut
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # the generation's generator seed; None: a fresh one (reported in Stats.seed)
    # turbo.sequence.penalties: applied at every committed position (speculation stays exact)
    repetition_penalty: float = 1.0  # transformers' / vLLM's: > 1 discourages the prompt's and output's tokens
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus this x the token's count in the output
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus this when the token is in the output
    logit_bias: tuple[tuple[int, float], ...] | None = None  # {token id: bias in [-100, 100]} (a dict or pairs)
    # turbo.sequence.grammar: OpenAI's response_format ({"type": "json_object"}, {"type": "json_schema", ...}) or
    # turbo's regex / Lark grammar ({"type": "regex", "regex": ...}, {"type": "grammar", "grammar": ...})
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        """Every check these fields allow on their own; numpy integers become ints and the
        sampling numbers floats. The block's range needs the drafter: turbo.sequence.policy.check_block."""
        for name in INTEGER_FIELDS:
            object.__setattr__(self, name, as_integer(name, getattr(self, name)))
        if self.max_new_tokens is None or self.max_new_tokens < 1:
            raise TurboError(f"max_new_tokens is {self.max_new_tokens!r}, expected a positive integer",
                             field="max_new_tokens")
        if self.rollback not in ROLLBACKS:
            raise TurboError(f"rollback {self.rollback!r} is not one of {', '.join(ROLLBACKS)}", field="rollback")
        if self.truncate_prompt not in TRUNCATIONS:
            raise TurboError(f"truncate_prompt {self.truncate_prompt!r} is not one of {', '.join(TRUNCATIONS)}",
                             field="truncate_prompt")
        check_flag("stop_at_eos", self.stop_at_eos)
        if not isinstance(self.drafter, str) and not is_drafter(self.drafter):
            raise TurboError(f"drafter {self.drafter!r} is not one of {', '.join(OWN_DRAFTERS)} nor a "
                             "turbo.drafters.Drafter (turbo.drafters.DrafterBase has its defaults), "
                             "nor ngram (the n-gram drafter, no weights)", field="drafter")
        if not isinstance(self.ngram, NgramConfig):
            raise TurboError(f"ngram {self.ngram!r} is not a turbo.drafters.ngram.NgramConfig", field="ngram")
        object.__setattr__(self, "stop", stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", stop_ids(self.stop_token_ids))
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p)
        check_seed(self.seed)
        check_penalties(self.repetition_penalty, self.frequency_penalty, self.presence_penalty)
        object.__setattr__(self, "logit_bias", logit_bias(self.logit_bias))
        object.__setattr__(self, "response_format", ResponseFormat.parse(self.response_format))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repetition_penalty, self.frequency_penalty, self.presence_penalty, self.logit_bias or ())

    def but(self, **changes) -> "GenerationOptions":
        return replace(self, **changes)


GENERATION_FIELDS = tuple(f.name for f in fields(GenerationOptions))
OPEN_FIELDS = tuple(f.name for f in fields(OpenOptions))


def policy_from_env(drafter: str) -> tuple[str, int | None]:
    """(policy, block) from TURBO_DFLASH_DRAFT / TURBO_MTP_DRAFT for a caller that named no
    policy. Unset and unparsable both mean auto: a typo must not silently disable a feature
    the install can serve. 0 = off, n > 0 = fixed n."""
    raw = os.environ.get(POLICY_ENVS.get(drafter, POLICY_ENVS["dflash"]), "").strip()
    try:
        n = int(raw)
    except ValueError:
        return "auto", None
    if n < 0:
        return "auto", None
    return ("off", None) if n == 0 else ("fixed", n)


MAX_N = 16  # choices one request may ask for (n): Runtime.choices, task=generate's n=, the server's n


def check_n(n: object) -> int:
    """n, the number of choices: an integer 1..MAX_N, else a TurboError naming n."""
    k = integer(n)
    if k is None or not 1 <= k <= MAX_N:
        raise TurboError(f"n is {n!r}, expected an integer from 1 to {MAX_N} (the choices of one request)", field="n")
    return k


def check_logprobs(k: object) -> int | None:
    """logprobs, the alternatives reported beside each token: None (none) or an integer 0..MAX_TOP
    (the server's logprobs / top_logprobs, the scheduler's Request.logprobs)."""
    n = integer(k)
    if k is not None and (n is None or not 0 <= n <= MAX_TOP):
        raise TurboError(f"logprobs is {k!r}, expected an integer in 0..{MAX_TOP}", field="logprobs")
    return n


class ContextTooLong(TurboError):
    """A prompt and max_new_tokens that do not fit the model's context together. `fit_context` is the
    one place this is checked; the message is turbo's, and the server says it in OpenAI's words from
    the numbers (turbo/serve/limits.py, context_error)."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, limit: int, hint: str = ""):
        super().__init__(f"prompt of {prompt_tokens} tokens + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"max_position_embeddings {limit}{hint}", field="max_new_tokens")
        self.prompt_tokens, self.max_new_tokens, self.limit = prompt_tokens, max_new_tokens, limit


def fit_context(ids: list[int], o: GenerationOptions, limit: int, keeps_state: bool = False) -> list[int]:
    """`ids` when they leave room for o.max_new_tokens in a context of `limit` positions; else their
    tail under truncate_prompt=left (a fresh prompt's only: a session's state, `keeps_state`, holds
    its conversation); else ContextTooLong."""
    room = limit - o.max_new_tokens
    if len(ids) <= room:
        return ids
    if o.truncate_prompt == "left" and room >= 1 and not keeps_state:
        return ids[-room:]
    hint = f" (truncate_prompt=left keeps its last {room})" if room >= 1 and not keeps_state else ""
    raise ContextTooLong(len(ids), o.max_new_tokens, limit, hint)


def integer(value: object) -> int | None:
    """`value` as an int when it is a Python or numpy integer, else None. bool is an int subclass
    in Python, and True as a block or a token id is a mistake rather than a 1: None too."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_integer(name: str, value: object) -> int | None:
    """`value` (None, or an integer as `integer` takes it) as an int or None; TurboError otherwise."""
    n = integer(value)
    if n is None and value is not None:
        raise TurboError(f"{name} is {value!r}, expected an integer", field=name)
    return n


def check_threads(threads: object) -> None:
    """torch.set_num_threads takes any int: -1 is a traceback from deep inside torch, and far more
    threads than the machine has cores a crash (100000 segfaults)."""
    n = as_integer("threads", threads)
    cores = os.cpu_count() or 1
    if n is not None and not 1 <= n <= 4 * cores:
        raise TurboError(f"threads {n} is outside 1..{4 * cores} (up to 4x this machine's {cores} cores)",
                         field="threads")


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_sampling(temperature: object, top_k: object, top_p: object, min_p: object) -> None:
    """The sampling fields (turbo.sequence.sampling.SamplingParams), checked at temperature 0 too."""
    if not _number(temperature) or not 0 <= temperature < math.inf:
        raise TurboError(f"temperature is {temperature!r}, expected a finite number >= 0", field="temperature")
    if top_k is not None and (integer(top_k) is None or top_k < 0):
        raise TurboError(f"top_k is {top_k!r}, expected a non-negative integer or null (0 and null: no cut)",
                         field="top_k")
    if not _number(top_p) or not 0 < top_p <= 1:
        raise TurboError(f"top_p is {top_p!r}, expected a number in (0, 1]", field="top_p")
    if not _number(min_p) or not 0 <= min_p < 1:
        raise TurboError(f"min_p is {min_p!r}, expected a number in [0, 1)", field="min_p")


def check_penalties(repetition: object, frequency: object, presence: object) -> None:
    if not _number(repetition) or not 0 < repetition < math.inf:
        raise TurboError(f"repetition_penalty is {repetition!r}, expected a finite number > 0 (1: none)",
                         field="repetition_penalty")
    for name, v in (("frequency_penalty", frequency), ("presence_penalty", presence)):
        if not _number(v) or not -PENALTY_RANGE <= v <= PENALTY_RANGE:
            raise TurboError(f"{name} is {v!r}, expected a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]",
                             field=name)


TOKEN_ID_DIGITS = 18  # a logit_bias key's most digits (past any vocabulary: its range is checked at the stream)


def logit_bias(bias: object) -> tuple[tuple[int, float], ...] | None:
    """`bias` (None, a {token id: bias} mapping or (id, bias) pairs; ids as integers or their
    decimal strings, as JSON keys are) as sorted (id, bias) pairs, or None when empty. The ids'
    range needs the vocabulary: checked when a stream starts."""
    if bias is None:
        return None
    items = list(bias.items()) if isinstance(bias, Mapping) else list(bias) if isinstance(bias, (list, tuple)) else None
    out = {}
    for item in items if items is not None else [None]:
        tok, value = item if isinstance(item, (tuple, list)) and len(item) == 2 else (None, None)
        # a string key as OpenAI's are: a token id in ASCII decimal digits ("²" and "٣" are no id)
        tid = ascii_decimal(tok, TOKEN_ID_DIGITS) if isinstance(tok, str) else integer(tok)
        if tid is None or tid < 0 or not _number(value) or not -BIAS_RANGE <= value <= BIAS_RANGE:
            key = f" (key {json_shown(tok)}: not a token id in ASCII decimal digits)" if isinstance(tok, str) and \
                tid is None else ""
            raise TurboError(f"logit_bias is {repr(bias)[:200]}, expected a map of token ids to biases in "
                             f"[-{BIAS_RANGE:g}, {BIAS_RANGE:g}]{key}", field="logit_bias")
        out[tid] = float(value)
    return tuple(sorted(out.items())) or None


def stop_strings(stop: object) -> tuple[str, ...] | None:
    """`stop` (None, a str, or a list/tuple of them) as a tuple of non-empty strings or None."""
    if stop is None:
        return None
    given = (stop,) if isinstance(stop, str) else stop
    if not isinstance(given, (list, tuple)) or not all(isinstance(s, str) and s for s in given):
        raise TurboError(f"stop is {stop!r}, expected a non-empty string or a list of them", field="stop")
    return tuple(given) or None


def stop_ids(ids: object) -> tuple[int, ...] | None:
    """`ids` (None, or a list/tuple of integers as `integer` takes them) as a tuple of ints or None."""
    if ids is None:
        return None
    given = [integer(t) for t in ids] if isinstance(ids, (list, tuple)) else [None]
    if None in given or any(t < 0 for t in given):
        raise TurboError(f"stop_token_ids is {ids!r}, expected a list of token ids (non-negative integers)",
                         field="stop_token_ids")
    return tuple(given) or None


def check_flag(name: str, value: object) -> None:
    """A yes/no field is a bool: a string such as "false" would read as true."""
    if not isinstance(value, bool):
        raise TurboError(f"{name} is {value!r}, expected true or false", field=name)


def check_seed(seed: object) -> None:
    # the generator's seed is 64 bits (torch.Generator.manual_seed): a larger one is refused, not wrapped
    if seed is not None and (integer(seed) is None or not 0 <= seed < 2**64):
        raise TurboError(f"seed is {seed!r}, expected a non-negative integer or null (a fresh seed), below 2**64",
                         field="seed")
