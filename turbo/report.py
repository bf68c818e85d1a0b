"""python -m turbo.report DIR: merge the probe's metrics.json files under DIR into one report.

    python -m turbo.report multirun/2026-11-29/12-00-00

`load` reads every metrics.json below DIR, `merge` joins configurations measured more than once,
`markdown` writes DIR/report.md and `plot` DIR/report.png; what they hold: docs/probe.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .errors import TurboError
from .extras import require
from .probe import SCHEMA, pos_range

RUN_KEYS = ("workload", "policy", "block", "rollback", "accepted_per_round", "rollback_rate",
            "per_position_acceptance", "mean_acceptance_length", "tokens_per_s", "speedup_vs_off", "generated_tokens")


class ReportError(Exception):
    pass


def load(directory: Path) -> tuple[list[dict], list[Path]]:
    if not directory.is_dir():
        raise ReportError(f"{directory}: not a directory (expected a multirun or probe output directory)")
    files = sorted(p for p in directory.rglob("metrics.json") if p.is_file())
    if not files:
        raise ReportError(f"{directory}: no metrics.json below it (expected the output of python -m turbo task=probe)")
    runs = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ReportError(f"{f}: not readable JSON ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            got = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ReportError(f"{f}: schema is {got!r}, expected {SCHEMA!r}")
        if not isinstance(data.get("runs"), list) or not data["runs"]:
            raise ReportError(f"{f}: 'runs' is missing or empty")
        for i, r in enumerate(data["runs"]):
            missing = [k for k in RUN_KEYS if not isinstance(r, dict) or k not in r]
            if missing:
                raise ReportError(f"{f}: runs[{i}] lacks {', '.join(missing)}")
            if r["policy"] not in ("off", "fixed", "adaptive"):
                raise ReportError(f"{f}: runs[{i}] has policy {r['policy']!r}, expected off, fixed or adaptive")
            if not isinstance(r["tokens_per_s"], (int, float)) or not isinstance(r["block"], int):
                raise ReportError(f"{f}: runs[{i}]: tokens_per_s and block must be numbers")
            runs.append(dict(r, source=str(f.relative_to(directory)), drafter=str(data.get("drafter")),
                             draft_products=str(data.get("draft_products", "auto"))))
    # drafter=dflash,mtp or draft_products=fp32,int8 side by side: a row group for each
    tags = [k for k in ("drafter", "draft_products") if len({r[k] for r in runs}) > 1]
    if tags:
        for r in runs:
            r["workload"] = f"{r['workload']} [{' '.join(r[k] for k in tags)}]"
    return runs, files


def merge(runs: list[dict]) -> list[dict]:
    """One row per (workload, rollback, policy, block): counts from the first, times averaged."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        key = (r["workload"], r["rollback"] if r["policy"] != "off" else None, r["policy"], r["block"])
        groups.setdefault(key, []).append(r)
    rows = []
    for key, rs in groups.items():
        row = dict(rs[0])
        row["rollback"] = key[1]
        row["jobs"] = len(rs)
        row["tokens_per_s"] = sum(r["tokens_per_s"] for r in rs) / len(rs)
        sp = [r["speedup_vs_off"] for r in rs if isinstance(r.get("speedup_vs_off"), (int, float))]
        row["speedup_vs_off"] = sum(sp) / len(sp) if sp else None
        row["counts_agree"] = all(r["accepted_per_round"] == rs[0]["accepted_per_round"] for r in rs)
        rows.append(row)
    order = {"off": 0, "fixed": 1, "adaptive": 2}
    rows.sort(key=lambda r: (r["workload"], r["rollback"] or "", order[r["policy"]], r["block"]))
    return rows


def fastest(rows: list[dict]) -> tuple[dict, dict]:
    """Best fixed row per (workload, rollback) and per workload (by speedup over off, else tokens/s)."""
    def score(r):
        return r["speedup_vs_off"] if r["speedup_vs_off"] is not None else r["tokens_per_s"]

    per_strategy, per_workload = {}, {}
    for r in rows:
        if r["policy"] != "fixed":
            continue
        k = (r["workload"], r["rollback"])
        if k not in per_strategy or score(r) > score(per_strategy[k]):
            per_strategy[k] = r
        if r["workload"] not in per_workload or score(r) > score(per_workload[r["workload"]]):
            per_workload[r["workload"]] = r
    return per_strategy, per_workload


def markdown(rows: list[dict], files: list[Path]) -> str:
    per_strategy, per_workload = fastest(rows)
    out = [f"# Probe report ({len(files)} metrics.json)", "",
           "Counts (accepted per round, rollback rate, per-position acceptance) are deterministic; tokens/s and "
           "speedup are wall clock, read for ordering only (speedup: each job against its own off).", "",
           "| workload | rollback | policy | block | accepted per round | rollback rate | per-position acceptance | "
           "mean acceptance length | tokens/s | speedup over off |",
           "| --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        best = per_strategy.get((r["workload"], r["rollback"])) is r
        blk = f"{r['block']}" + (f" (mean {r['mean_block']:.2f})" if r["policy"] == "adaptive" and "mean_block" in r else "")
        sp = f"{r['speedup_vs_off']:.2f}x" if r["speedup_vs_off"] is not None else "-"
        tps = f"{r['tokens_per_s']:.1f}"
        if best:
            tps, sp = f"**{tps}**", f"**{sp}**"
        out.append(f"| {r['workload']} | {r['rollback'] or '-'} | {r['policy']} | {blk} | "
                   f"{r['accepted_per_round']:.2f} | {r['rollback_rate']:.0%} | {pos_range(r['per_position_acceptance'])} | "
                   f"{r['mean_acceptance_length']:.2f} | {tps} | {sp} |")
    out += ["", "Fastest fixed block (bold above):" if per_strategy else "No fixed block measured.", ""]
    for (wl, rb), r in sorted(per_strategy.items()):
        sp = f", {r['speedup_vs_off']:.2f}x off" if r["speedup_vs_off"] is not None else ""
        out.append(f"- {wl}, rollback {rb}: block {r['block']} ({r['tokens_per_s']:.1f} tok/s{sp})")
    for wl, r in sorted(per_workload.items()):
        out.append(f"- {wl}, any strategy: block {r['block']} with rollback {r['rollback']}")
    adaptive = [r for r in rows if r["policy"] == "adaptive"]
    if adaptive:
        out += ["", "Adaptive against the fastest fixed block of the same workload and strategy:", ""]
        for r in adaptive:
            best = per_strategy.get((r["workload"], r["rollback"]))
            vs = f"{r['tokens_per_s'] / best['tokens_per_s']:.2f}x block {best['block']}" if best else "no fixed block measured"
            sp = f"{r['speedup_vs_off']:.2f}x off" if r["speedup_vs_off"] is not None else "-"
            out.append(f"- {r['workload']}, rollback {r['rollback']}: {r['tokens_per_s']:.1f} tok/s = {vs}, {sp}")
    if not all(r.get("same_text_as_off", True) for r in rows):
        bad = [f"{r['workload']}/{r['rollback']}/{r['policy']} {r['block']}" for r in rows if not r.get("same_text_as_off", True)]
        out += ["", "LOSSLESS VIOLATION (text differs from off): " + ", ".join(bad)]
    if not all(r["counts_agree"] for r in rows):
        out += ["", "WARNING: jobs measuring the same configuration disagree on counts"]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    require("matplotlib", "sweeps").use("Agg")
    import matplotlib.pyplot as plt  # the sweeps extra, named by require() above when missing

    strategies = sorted({r["rollback"] for r in rows if r["policy"] != "off"}) or ["-"]
    workloads = sorted({r["workload"] for r in rows})
    colors = {w: f"C{i}" for i, w in enumerate(workloads)}
    fig, axes = plt.subplots(2, len(strategies), figsize=(5.5 * len(strategies), 7.5), squeeze=False)
    for j, rb in enumerate(strategies):
        top, bottom = axes[0][j], axes[1][j]
        for wl in workloads:
            fixed = sorted((r for r in rows if r["workload"] == wl and r["rollback"] == rb and r["policy"] == "fixed"),
                           key=lambda r: r["block"])
            if fixed:
                xs = [r["block"] for r in fixed]
                top.plot(xs, [r["tokens_per_s"] for r in fixed], "o-", color=colors[wl], label=wl)
                bottom.plot(xs, [r["accepted_per_round"] for r in fixed], "o-", color=colors[wl], label=wl)
            off = [r for r in rows if r["workload"] == wl and r["policy"] == "off"]
            if off:
                top.axhline(off[0]["tokens_per_s"], color=colors[wl], ls="--", lw=1)
            ad = [r for r in rows if r["workload"] == wl and r["rollback"] == rb and r["policy"] == "adaptive"]
            if ad:
                top.axhline(ad[0]["tokens_per_s"], color=colors[wl], ls=":", lw=1.5)
        top.set_title(f"rollback: {rb}")
        top.set_ylabel("tokens/s (ordering only)")
        bottom.set_ylabel("accepted per round")
        bottom.set_xlabel("block")
        ticks = sorted({r["block"] for r in rows if r["policy"] == "fixed"})
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            if ticks:
                ax.set_xticks(ticks)
        if bottom.get_legend_handles_labels()[0]:
            bottom.legend(fontsize=8)
    fig.suptitle("turbo probe: fixed blocks (lines), off (dashed), adaptive (dotted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m turbo.report DIR   (a multirun directory of task=probe jobs)", file=sys.stderr)
        return 2
    directory = Path(argv[0])
    try:
        runs, files = load(directory)
        rows = merge(runs)
        text = markdown(rows, files)
        (directory / "report.md").write_text(text)
        plot(rows, directory / "report.png")
    except (ReportError, TurboError) as e:  # TurboError: matplotlib, an optional extra, missing
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {directory}: {e}", file=sys.stderr)
        return 2
    print(text, end="")
    print(f"[report] wrote {directory / 'report.md'} and {directory / 'report.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
