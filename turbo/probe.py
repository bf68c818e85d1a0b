"""task=probe: the accept-length probe (docs/probe.md; docs/DESIGN.md 8).

    python -m turbo task=probe [probe.workloads=[prose,code,math]] [+policy=fixed block=4]

`run_probe` decodes every workload with `off` and each configured block / adaptive, round-robin per
prompt, prints `tables` and writes metrics.json (schema SCHEMA, described in docs/probe.md).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from . import shipped
from .config import RunConfig
from .engine import Runtime
from .engine import open as open_runtime
from .errors import TurboError
from .sequence.options import GenerationOptions
from .sequence.policy import check_policy
from .sequence.sampling import sampling_label
from .sequence.stats import COUNT_FIELDS, Counts

SCHEMA = "turbo.probe/1"
DEFAULT_BLOCKS = (1, 2, 4, 7, 8)
TIMING_NOTE = "wall-clock figures (wall_s, tokens_per_s, speedup_vs_off) are read for ordering only"


@dataclass
class Agg:
    """One configuration's counters summed over the prompts."""

    workload: str
    policy: str
    block: int
    rollback: str | None
    max_new_tokens: int
    counts: Counts = field(default_factory=Counts)
    prompts: int = 0
    wall_s: float = 0.0
    mismatched: list[int] = field(default_factory=list)

    def add(self, stats: Counts, wall: float) -> None:
        self.counts.add(stats)
        self.prompts += 1
        self.wall_s += wall

    @property
    def label(self) -> str:
        return {"off": "off", "adaptive": "adaptive"}.get(self.policy, str(self.block))

    def as_dict(self, off: "Agg | None") -> dict:
        c = self.counts
        tps = c.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0
        off_tps = off.counts.generated_tokens / off.wall_s if off is not None and off.wall_s > 0 else 0.0
        return {
            "workload": self.workload, "policy": self.policy, "block": self.block, "rollback": self.rollback,
            "prompts": self.prompts, "max_new_tokens": self.max_new_tokens,
            **{name: getattr(c, name) for name in COUNT_FIELDS}, **c.derived(),
            "mean_block": c.drafted / (c.rounds or 1),
            "same_text_as_off": not self.mismatched, "mismatched_prompts": list(self.mismatched),
            "wall_s": self.wall_s, "tokens_per_s": tps,
            "speedup_vs_off": tps / off_tps if off_tps > 0 else None,
        }


def _list(node, what: str) -> list | None:
    if node is None:
        return None
    if isinstance(node, (ListConfig, list, tuple)):
        return list(node)
    if isinstance(node, (str, int)) and not isinstance(node, bool):
        return [node]
    raise TurboError(f"config: {what}={node!r}, expected a list or null")


def _workload_prompts(name: str) -> tuple[list[str], int]:
    path = shipped.CONF_DIR / "workload" / f"{name}.yaml"
    if not path.is_file():
        have = ", ".join(sorted(p.stem for p in (shipped.CONF_DIR / "workload").glob("*.yaml")))
        raise TurboError(f"probe.workloads: no workload {name!r} (conf/workload has {have})")
    w = OmegaConf.load(path)
    return [str(p) for p in w.prompts], int(w.max_new_tokens)


def output_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # not running under @hydra.main (the API, tests)
        return Path.cwd()


def _overrides() -> list[str]:
    try:
        return list(HydraConfig.get().overrides.task)
    except Exception:
        return []


def pos_range(p: list[float]) -> str:
    """Per-position acceptance as its range ("0.41-0.77"; one value when flat)."""
    if not p:
        return "-"
    lo, hi = min(p), max(p)
    return f"{lo:.2f}" if abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}"


def tables(workload: str, runs: list[dict], prompts: int, max_new: int, sampling: str | None = None) -> str:
    """The probe's three tables for one workload (markdown). sampling: None for greedy, else
    what the tokens were sampled with ("T 0.7 seed 0"): then tokens are not compared with off's."""
    off = next((r for r in runs if r["policy"] == "off"), None)
    spec = [r for r in runs if r["policy"] != "off"]
    strategies = list(dict.fromkeys(r["rollback"] for r in spec))
    cols = list(dict.fromkeys((r["policy"], r["block"]) for r in spec))

    def head(c):
        return "adaptive" if c[0] == "adaptive" else f"block {c[1]}"

    def find(rb, c):
        return next((r for r in spec if r["rollback"] == rb and (r["policy"], r["block"]) == c), None)

    out = [f"### {workload} ({prompts} prompts x {max_new} {'greedy' if sampling is None else 'sampled'} tokens"
           f"{'' if sampling is None else ', ' + sampling})", ""]
    if spec:
        fixed = [c for c in cols if c[0] == "fixed"]
        out += ["accepted per round (deterministic):", "",
                "| rollback | per-position acceptance | " + " | ".join(head(c) for c in cols) + " |",
                "| --- | --- | " + " | ".join("---:" for _ in cols) + " |"]
        for rb in strategies:
            widest = find(rb, fixed[-1]) if fixed else None
            pos = pos_range(widest["per_position_acceptance"]) if widest else "-"
            cells = [f"{find(rb, c)['accepted_per_round']:.2f}" if find(rb, c) else "" for c in cols]
            out.append(f"| {rb} | {pos} | " + " | ".join(cells) + " |")
        out += ["", "rollback rate (deterministic):", "",
                "| rollback | " + " | ".join(head(c) for c in cols) + " |",
                "| --- | " + " | ".join("---:" for _ in cols) + " |"]
        for rb in strategies:
            cells = [f"{find(rb, c)['rollback_rate']:.0%}" if find(rb, c) else "" for c in cols]
            out.append(f"| {rb} | " + " | ".join(cells) + " |")
    out += ["", "per configuration (tokens/s and speedup: wall clock, for ordering only):", "",
            "| rollback | policy | block | per-position acceptance | mean acceptance length | tokens/s | speedup over off |",
            "| --- | --- | ---: | --- | ---: | ---: | ---: |"]
    if off is not None:
        out.append(f"| - | off | 0 | - | 1.00 | {off['tokens_per_s']:.1f} | 1.00x |")
    for rb in strategies:
        for c in cols:
            r = find(rb, c)
            if r is None:
                continue
            pos = " ".join(f"{p:.2f}" for p in r["per_position_acceptance"]) or "-"
            blk = f"{r['block']} (mean {r['mean_block']:.2f})" if r["policy"] == "adaptive" else str(r["block"])
            sp = f"{r['speedup_vs_off']:.2f}x" if r["speedup_vs_off"] is not None else "-"
            out.append(f"| {rb} | {r['policy']} | {blk} | {pos} | {r['mean_acceptance_length']:.2f} | "
                       f"{r['tokens_per_s']:.1f} | {sp} |")
    bad = [r for r in spec if not r.get("same_text_as_off", True)]
    if sampling is not None:
        out += ["", "lossless: not compared (sampling: a speculative and a plain run sample the same distribution, "
                    "not the same tokens; tests/test_sampling.py checks the distribution)"]
    elif not spec:
        out += ["", "lossless: nothing to compare (off alone)"]
    elif bad:
        out += [""] + [f"LOSSLESS VIOLATION: {r['policy']} block {r['block']} rollback {r['rollback']} differs from off "
                       f"on prompt(s) {r['mismatched_prompts']}" for r in bad]
    else:
        out += ["", f"lossless: all {len(spec)} configurations produced exactly off's tokens on all {prompts} prompts"]
    return "\n".join(out)


@dataclass(frozen=True)
class ProbeSettings:
    """task=probe's `probe.*` keys (conf/task/probe.yaml) as the run reads them: the run's policy
    applied (`from_config`), each field checked as it is set, as the option types check theirs."""

    blocks: tuple[int, ...] = DEFAULT_BLOCKS  # the fixed blocks decoded
    adaptive: bool = True  # also decode +policy=adaptive
    rollbacks: tuple[str, ...] = ("checkpoint",)  # each configuration's rollbacks (the config's: the run's)
    workloads: tuple[str, ...] = ()  # the workloads decoded (the config's null: the run's)
    prompts_per_workload: int | None = None  # None: every prompt; n: the first n
    past_eos: bool = False  # True: max_new_tokens per prompt past the end of text

    def __post_init__(self) -> None:
        for b in self.blocks:
            if isinstance(b, bool) or not isinstance(b, int):
                raise TurboError(f"probe.blocks: {b!r} is not an integer")
        per = self.prompts_per_workload
        if per is not None and (isinstance(per, bool) or not isinstance(per, int) or per < 1):
            raise TurboError(f"config: probe.prompts_per_workload={per!r}, expected a positive integer or null")
        if not isinstance(self.past_eos, bool):
            raise TurboError(f"config: probe.past_eos={self.past_eos!r}, expected true or false")

    @classmethod
    def from_config(cls, pc: DictConfig, g: GenerationOptions, workload: str) -> "ProbeSettings":
        """The `probe` node's keys, where the run's +policy narrows them: fixed decodes its block
        alone, adaptive adaptive alone, off neither (only off)."""
        blocks = _list(pc.get("blocks", list(DEFAULT_BLOCKS)), "probe.blocks") or []
        adaptive = bool(pc.get("adaptive", True))
        if g.policy is not None:
            check_policy(g.policy, g.block)  # (the probe's own configurations are decided by plan_probe, by the same room)
        if g.policy == "fixed":
            blocks, adaptive = [g.block], False
        elif g.policy == "adaptive":
            blocks, adaptive = [], True
        elif g.policy == "off":
            blocks, adaptive = [], False
        rollbacks = [str(r) for r in (_list(pc.get("rollbacks"), "probe.rollbacks") or [g.rollback])]
        workloads = [str(w) for w in (_list(pc.get("workloads"), "probe.workloads") or [workload])]
        return cls(tuple(blocks), adaptive, tuple(rollbacks), tuple(workloads), pc.get("prompts_per_workload"),
                   pc.get("past_eos", False))


Config = tuple[str | None, int, str | None]  # (rollback, block, policy): (None, 0, None) is off


@dataclass
class ProbePlan:
    """What a probe decodes, every configuration checked against the install before any decoding."""

    settings: ProbeSettings
    rt: Runtime
    configs: list[Config]  # off first
    drafter: str | None  # the drafter the configurations speculate with (None: off alone)
    sampling: str | None  # None: greedy (tokens compared with off's); else sampling_label's
    max_new_tokens: int | None  # max_new_tokens= given (each workload's own otherwise)
    prompt_given: bool  # prompt= given: the run's workload decodes it alone


def plan_probe(cfg: DictConfig, rc: RunConfig, quiet: bool = False, runtime: Runtime | None = None) -> ProbePlan:
    """The settings, the runtime (`runtime`, or rc's install opened here) and the configurations,
    each decided by the install (a bad block fails in seconds, before anything decodes)."""
    g = rc.generation
    settings = ProbeSettings.from_config(cfg.get("probe") or OmegaConf.create({}), g, rc.workload)
    # under sampling the tokens differ from off's by design: only greedy runs are compared
    sampling = None if g.temperature == 0 else sampling_label(g)
    rt = runtime if runtime is not None else open_runtime(rc.install, rc.opening)
    plans = {b: rt.plan("fixed", b, g.drafter, g.window) for b in settings.blocks}
    adaptive_plan = rt.plan("adaptive", None, g.drafter, g.window) if settings.adaptive else None
    if adaptive_plan is not None and adaptive_plan.drafter is None:
        raise TurboError(f"adaptive cannot speculate: {adaptive_plan.off_reason}")
    if rt.backend.note and rt.options.verbose and not quiet:  # after the checks: a refusal stays one line
        print(rt.backend.note, file=sys.stderr)
    drafter = next((p.drafter for p in plans.values()), adaptive_plan.drafter if adaptive_plan else None)
    configs: list[Config] = [(None, 0, None)] + [(rb, b, "fixed") for rb in settings.rollbacks for b in settings.blocks]
    if adaptive_plan is not None:
        configs += [(rb, adaptive_plan.block, "adaptive") for rb in settings.rollbacks]
    return ProbePlan(settings, rt, configs, drafter, sampling, cfg.get("max_new_tokens"), cfg.get("prompt") is not None)


def run_plan(plan: ProbePlan, rc: RunConfig, quiet: bool = False) -> list[dict]:
    """Every workload's prompts decoded with each configuration in turn (round-robin per prompt),
    its tables printed; the runs' rows (Agg.as_dict) of all workloads."""
    g, rt, configs, s = rc.generation, plan.rt, plan.configs, plan.settings
    stop_at_eos = not s.past_eos

    def gen(prompt, policy, block, rb, n):
        return rt.generate(prompt, g, max_new_tokens=n, policy=policy, block=block if policy == "fixed" else None,
                           rollback=rb or g.rollback, stop_at_eos=stop_at_eos)

    all_runs = []
    for wl in s.workloads:
        if plan.prompt_given and wl == rc.workload:
            prompts, own_max = [rc.prompt], g.max_new_tokens
        elif wl == rc.workload:
            prompts, own_max = list(rc.prompts), g.max_new_tokens
        else:
            prompts, own_max = _workload_prompts(wl)
        if s.prompts_per_workload is not None:
            prompts = prompts[:s.prompts_per_workload]
        max_new = int(plan.max_new_tokens) if plan.max_new_tokens is not None else own_max
        aggs = {c: Agg(wl, c[2] or "off", c[1], c[0], max_new) for c in configs}
        for rb, b, pol in configs:  # warm up: build drafters, touch every code path once
            gen(prompts[0], pol or "off", b, rb, 2)
        for i, prompt in enumerate(prompts):
            ref = None
            for c in configs:
                rb, b, pol = c
                t = time.perf_counter()
                res = gen(prompt, pol or "off", b, rb, max_new)
                wall = time.perf_counter() - t
                aggs[c].add(res.stats, wall)
                if pol is None:
                    ref = res.tokens
                elif plan.sampling is None and res.tokens != ref:
                    aggs[c].mismatched.append(i)
        off = aggs[configs[0]]
        runs = [a.as_dict(off) for a in aggs.values()]
        if plan.sampling is not None:  # tokens were not compared: no claim either way
            runs = [{k: v for k, v in r.items() if k not in ("same_text_as_off", "mismatched_prompts")} for r in runs]
        all_runs += runs
        if not quiet:
            print(tables(wl, runs, len(prompts), max_new, plan.sampling) + "\n", flush=True)
    return all_runs


def write_metrics(plan: ProbePlan, rc: RunConfig, runs: list[dict], out_dir: str | Path | None = None,
                  quiet: bool = False) -> int:
    """metrics.json (schema SCHEMA) into `out_dir` (None: Hydra's output directory); 1 when a
    greedy configuration's tokens differed from off's, else 0."""
    g, s = rc.generation, plan.settings
    lossless = None if plan.sampling is not None else all(r["same_text_as_off"] for r in runs)
    metrics = {
        "schema": SCHEMA, "install": rc.install, "backend": plan.rt.backend.name, "drafter": plan.drafter,
        "ngram": asdict(g.ngram) if plan.drafter == "ngram" else None,
        "draft_products": rc.opening.draft_products, "window": g.window, "max_new_tokens": plan.max_new_tokens,
        "blocks": list(s.blocks), "adaptive": s.adaptive,
        "rollbacks": list(s.rollbacks), "workloads": list(s.workloads), "prompts_per_workload": s.prompts_per_workload,
        "stop_at_eos": not s.past_eos,
        "overrides": _overrides(), "temperature": g.temperature, "top_k": g.top_k, "top_p": g.top_p,
        "min_p": g.min_p, "seed": g.seed,
        "lossless": lossless, "timing_note": TIMING_NOTE, "runs": runs,
    }
    out = Path(out_dir) if out_dir is not None else output_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "metrics.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    os.replace(tmp, path)
    if not quiet:
        print(f"[probe] {TIMING_NOTE}; counts are deterministic", file=sys.stderr)  # (reports: stderr)
        print(f"[probe] wrote {path}", file=sys.stderr)
    return 1 if lossless is False else 0


def run_probe(cfg: DictConfig, rc: RunConfig, out_dir: str | Path | None = None, quiet: bool = False,
              runtime: Runtime | None = None) -> int:
    """task=probe: plan, run, write. runtime: rc's install already open (the CLI's); None opens it here."""
    plan = plan_probe(cfg, rc, quiet, runtime)
    return write_metrics(plan, rc, run_plan(plan, rc, quiet), out_dir, quiet)
