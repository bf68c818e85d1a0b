"""scripts/measure_vs_llamacpp.py's output directory as (a) the README's "Measured" table and (b) a
docs/benchmarks.md section: every row's figures (medians of the undisturbed repetitions),
turbo against llama.cpp with the ratio, repetitions kept / dropped and the load around them;
then per step its command, date, commit, machine, load and the tables the bench script printed.

    python -m scripts.report_vs_llamacpp DIR > DIR/report.md

It reads the bench scripts' own outputs (the JSON where a script writes one, its printed
table otherwise) and measures nothing. A step that did not run (or failed) leaves its rows out
and is listed at the end.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

from scripts.measure_vs_llamacpp import STEPS

DIR = Path(sys.argv[1]) if len(sys.argv) > 1 else None
FORMATS = [("bf16", "turbo", "llama.cpp", "bf16"), ("int8", "turbo int8", "llama.cpp q8_0", "Q8_0"),
           ("int4", "turbo int4", "llama.cpp q4_0", "Q4_0")]
GUARD_LINE = re.compile(r"kept (\d+) of (\d+) repetitions, dropped (\d+).*?load average ([\d.]+)-([\d.]+)")
NUM = re.compile(r"-?\d+(?:\.\d+)?")


TITLES = {"scale512": "Qwen3.5-0.8B shape: bf16 / int8 / int4 against llama.cpp bf16 / Q8_0 / Q4_0 (and transformers), "
                        "load, memory, prefill and decode at 512",
          "scale4096": "The same at 4096 (llama.cpp only)",
          "serve_bf16": "Serving bf16 at 1 / 4 / 8 clients against llama-server --parallel 1 / 4 / 8",
          "llamabench_bf16": "llama-bench beside the Python binding, bf16 GGUF",
          "llamabench_q4_0": "llama-bench beside the Python binding, Q4_0 GGUF",
          "round": "Speculation end to end (scripted drafter)",
          "open_int4": "Open time, int4 install against the Q4_0 GGUF",
          "open_bf16": "Open time, bf16 install against the bf16 GGUF",
          "context": "Decode at 4096 against at 512",
          "moe": "The MoE shape (Qwen3.5-35B-A3B, 2 layers) against llama.cpp bf16 / Q4_0",
          "cotenant": "Beside one controlled co-tenant (against scale512's rows without it)",
          "llamabench_q8_0": "llama-bench beside the Python binding, Q8_0 GGUF",
          "serve_int4": "Serving int4 against llama-server on the Q4_0 GGUF",
          "session": "Chat session: TTFT of a later turn",
          "session_server": "Server prefix cache: TTFT of a later turn resent whole"}


# ---- reading the directory ---------------------------------------------------------------------


def meta(step: str) -> dict | None:
    """The step's record if it ran to exit 0."""
    p = DIR / f"{step}.meta.json"
    m = json.loads(p.read_text()) if p.is_file() else None
    return m if m and m.get("rc") == 0 else None


def jsonl(step: str) -> list[dict]:
    p = DIR / f"{step}.jsonl"
    if not meta(step) or not p.is_file():
        return []
    return [r for r in map(json.loads, p.read_text().splitlines()) if "system" in r]


def log(step: str) -> str:
    return (DIR / f"{step}.log").read_text() if meta(step) else ""


def guard_of(records: list[dict]) -> tuple[str, str]:
    """(kept / dropped, load range) of records carrying a benchlib guard dict."""
    gs = [r["guard"] for r in records if r.get("guard")]
    if not gs:
        return "-", "-"
    loads = [g["load1_before"] for g in gs] + [g["load1_after"] for g in gs]
    dropped = sum(g["disturbed"] for g in gs)
    off = "" if all(g.get("guard_on", True) for g in gs) else " (guard off)"
    return f"{len(gs) - dropped} / {dropped}{off}", f"{min(loads):.2f}-{max(loads):.2f}"


def guard_of_log(text: str) -> tuple[str, str]:
    """The same from a printed benchlib.guard_summary line."""
    m = GUARD_LINE.search(text)
    if not m:
        return "-", "-"
    off = " (guard off)" if "guard OFF" in text else ""
    return f"{m[1]} / {m[3]}{off}", f"{m[4]}-{m[5]}"


def median(records: list[dict], system: str, n: int | str, key: str) -> float | None:
    vals = [r[str(n)][key] for r in records if r["system"] == system and str(n) in r
            and not (r.get("guard") or {}).get("disturbed")]
    return statistics.median(vals) if vals else None


def top_median(records: list[dict], system: str, key: str) -> float | None:
    vals = [r[key] for r in records if r["system"] == system and not (r.get("guard") or {}).get("disturbed")]
    return statistics.median(vals) if vals else None


def peak(r: dict) -> float:
    return max([r["load_peak"]] + [r[k][p] for k in r if k.isdigit() for p in ("prefill_peak", "decode_peak")])


def table_rows(text: str, after: str = "") -> list[list[str]]:
    """The cells of the markdown table rows printed after the line containing `after`."""
    text = text.split(after, 1)[1] if after and after in text else text
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and "---" not in line]


def first(cell: str) -> float:
    return float(NUM.search(cell)[0])


def f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def slash(xs, fmt="{:.1f}") -> str:
    return " / ".join(f(x, fmt) for x in xs)


# ---- the rows ----------------------------------------------------------------------------------


def rows() -> list[dict]:
    out = []

    def row(step, what, turbo, against, ratio_, reps, load):
        out.append({"step": step, "what": what, "turbo": turbo, "against": against, "ratio": ratio_, "reps": reps,
                    "load": load})

    scale = jsonl("scale512") + jsonl("scale4096")
    steps = "+".join(s for s in ("scale512", "scale4096") if meta(s))
    lengths = sorted({int(k) for r in scale for k in r if k.isdigit()})
    ns = " / ".join(map(str, lengths))
    for fmt, tsys, lsys, gguf in FORMATS if scale else ():
        recs = [r for r in scale if r["system"] in (tsys, lsys)]
        reps, load = guard_of(recs)
        for key, what in (("decode_tps", f"decode tok/s at context {ns}"), ("prefill_tps", f"prefill {ns} tok/s")):
            t = [median(scale, tsys, n, key) for n in lengths]
            ll = [median(scale, lsys, n, key) for n in lengths]
            hf = ([median(scale, "transformers", n, key) for n in lengths] if fmt == "bf16" else [])
            extra = f", transformers {slash(hf)}" if any(x is not None for x in hf) else ""
            row(steps, f"{fmt} {what}, Qwen3.5-0.8B shape (random weights), 2 threads", slash(t),
                f"llama.cpp {gguf} {slash(ll)}{extra}", " / ".join(ratio(a, b) for a, b in zip(t, ll)), reps, load)
    s512 = jsonl("scale512")
    if s512:
        peaks = lambda sys_: [statistics.median(peak(r) for r in s512 if r["system"] == s) / 1e9  # noqa: E731
                              if any(r["system"] == s for r in s512) else None for s in sys_]
        loads = lambda sys_: [top_median(s512, s, "load_s") for s in sys_]  # noqa: E731
        t, ll = [x[1] for x in FORMATS], [x[2] for x in FORMATS]
        reps, load = guard_of(s512)
        row("scale512", "load s, bf16 / int8 / int4 (a fresh process)", slash(loads(t), "{:.2f}"),
            f"llama.cpp bf16 / Q8_0 / Q4_0 {slash(loads(ll), '{:.2f}')}",
            " / ".join(ratio(b, a) for a, b in zip(loads(t), loads(ll))) + " (llama.cpp's / turbo's)", reps, load)
        n512 = min(int(k) for r in s512 for k in r if k.isdigit())
        row("scale512", f"peak RSS GB, whole process (prompt {n512}), bf16 / int8 / int4", slash(peaks(t), "{:.2f}"),
            f"llama.cpp bf16 / Q8_0 / Q4_0 {slash(peaks(ll), '{:.2f}')}",
            " / ".join(ratio(b, a) for a, b in zip(peaks(t), peaks(ll))) + " (llama.cpp's / turbo's)", reps, load)

    if text := log("context"):
        m = re.findall(r"kv_cache (\S+): decode at (\d+) / at (\d+) = ([\d.]+)", text)
        cells = "; ".join(f"kv {kv} {r}" for kv, _, _, r in m)
        if m:
            row("context", f"decode at context {m[0][1]} / at {m[0][2]}, same shape, per K/V cache dtype", cells,
                "", "", *guard_of_log(text))

    if text := log("round"):
        recs = table_rows(text, "tok/s at acceptance")
        header = recs[0]
        b8 = header.index("block 8") if "block 8" in header else len(header) - 2
        got = {r[0]: first(r[b8]) / first(r[2]) for r in recs[1:] if r[0] in ("bf16", "int4", "int8")}
        row("round", "speculation end to end, same shape, scripted drafter landing 80%, block 8",
            ", ".join(f"{k} {v:.2f}x" for k, v in got.items()), "its own plain decode", "", *guard_of_log(text))

    for step, fmt in (("serve_bf16", "bf16"), ("serve_int4", "int4")):
        p = DIR / f"{step}.json"
        if not meta(step) or not p.is_file():
            continue
        data = json.loads(p.read_text())
        a = data["args"]
        runs = {(r["name"].startswith("turbo"), r["clients"]): r for r in data["runs"]}
        cs = sorted({c for _, c in runs})
        kept = lambda r: [x for x in r["reps"] if not x["guard"]["disturbed"]]  # noqa: E731
        fig = lambda own, c, k: (statistics.median(x[k] for x in kept(runs[own, c]))  # noqa: E731
                                 if (own, c) in runs and kept(runs[own, c]) else None)
        every = [x for r in data["runs"] for x in r["reps"]]
        reps, load = guard_of(every)
        checks = {own: ", ".join(f"{r['checked']['requests'] - r['checked']['mismatches']}/{r['checked']['requests']}"
                                 for (o, _), r in runs.items() if o == own) for own in (True, False)}
        clients = " / ".join(map(str, cs))
        what = (f"serving {fmt}, 0.8B shape, 2 threads, {a['requests']} requests x {a['max_tokens']} tokens: "
                f"aggregate tok/s at {clients} clients")
        t, ll = [fig(True, c, "tokens_per_s") for c in cs], [fig(False, c, "tokens_per_s") for c in cs]
        scaling = lambda xs: (" (" + " / ".join(ratio(x, xs[0]) for x in xs[1:]) + " one client's)"  # noqa: E731
                              if len(xs) > 1 else "")
        row(step, what, slash(t) + scaling(t),
            f"llama-server --parallel {clients} ({a['gguf']}) {slash(ll)}{scaling(ll)}",
            " / ".join(ratio(x, y) for x, y in zip(t, ll)), reps, load)
        lat = lambda own: "; ".join(  # noqa: E731
            f"{c}: {f(fig(own, c, 'ttft_p50_ms'), '{:.0f}')} / {f(fig(own, c, 'ttft_p99_ms'), '{:.0f}')}, "
            f"{f(fig(own, c, 'tpot_p50_ms'), '{:.0f}')} / {f(fig(own, c, 'tpot_p99_ms'), '{:.0f}')}" for c in cs)
        row(step, f"serving {fmt}: TTFT p50 / p99, per-token p50 / p99 ms, per client count; answers = alone",
            f"{lat(True)}; alone: {checks[True]}", f"llama-server {lat(False)}; alone: {checks[False]}", "",
            reps, load)

    opened = {}
    for step in ("open_int4", "open_bf16"):
        if text := log(step):
            for r in table_rows(text)[1:]:
                opened[(step, r[0].startswith("turbo"))] = first(r[1])
            opened[step] = guard_of_log(text)
    if opened:
        st = [s for s in ("open_int4", "open_bf16") if s in opened]
        t = [opened.get((s, True)) for s in st]
        ll = [opened.get((s, False)) for s in st]
        names = " / ".join(s.split("_")[1] for s in st)
        reps = "; ".join(opened[s][0] for s in st)
        load = "; ".join(opened[s][1] for s in st)
        row("+".join(st), f"open the 0.8B {names} install, s (its open layout mapped)", slash(t, "{:.2f}"),
            f"llama.cpp {names.replace('int4', 'Q4_0')} {slash(ll, '{:.2f}')}",
            " / ".join(ratio(b, a) for a, b in zip(t, ll)) + " (llama.cpp's / turbo's)", reps, load)

    if moe := jsonl("moe"):
        n = min(int(k) for r in moe for k in r if k.isdigit())
        reps, load = guard_of(moe)
        for key, what in (("decode_tps", f"decode tok/s at {n}"), ("prefill_tps", f"prefill {n} tok/s")):
            t = [median(moe, s, n, key) for s in ("turbo", "turbo int4")]
            ll = [median(moe, s, n, key) for s in ("llama.cpp", "llama.cpp q4_0")]
            row("moe", f"MoE shape (Qwen3.5-35B-A3B, 2 layers), bf16 / int4, {what}", slash(t),
                f"llama.cpp bf16 / Q4_0 {slash(ll)}", " / ".join(ratio(a, b) for a, b in zip(t, ll)), reps, load)
        pk = lambda s_: statistics.median(peak(r) for r in moe if r["system"] == s_) / 1e9  # noqa: E731
        t, ll = [pk("turbo"), pk("turbo int4")], [pk("llama.cpp"), pk("llama.cpp q4_0")]
        row("moe", "MoE shape, bf16 / int4, peak RSS GB, whole process", slash(t, "{:.2f}"),
            f"llama.cpp bf16 / Q4_0 {slash(ll, '{:.2f}')}",
            " / ".join(ratio(b, a) for a, b in zip(t, ll)) + " (llama.cpp's / turbo's)", reps, load)

    for kind in ("bf16", "q8_0", "q4_0"):
        step = f"llamabench_{kind}"
        p = DIR / f"{step}.json"
        if not meta(step) or not p.is_file():
            continue
        data = json.loads(p.read_text())
        seen = {(fig, who): statistics.median(v) for _, fig, who, v in data["figures"]}
        figs = list(dict.fromkeys(fig for fig, _ in seen))
        b = [seen.get((fig, "binding")) for fig in figs]
        lb = [seen.get((fig, "llama-bench")) for fig in figs]
        reps, load = guard_of_log(log(step))  # (every llama-bench run and binding worker)
        row(step, f"llama.cpp {kind}: the Python binding (turbo column) beside llama-bench, {' / '.join(figs)} tok/s",
            slash(b), f"llama-bench {slash(lb)}", " / ".join(ratio(x, y) for x, y in zip(b, lb))
            + " (binding / llama-bench)", reps, load)

    if (co := jsonl("cotenant")) and s512:
        n = min(int(k) for r in co for k in r if k.isdigit())
        reps, load = guard_of(co)
        for key, what in (("decode_tps", f"decode tok/s at {n}"), ("prefill_tps", f"prefill {n} tok/s")):
            t, t0 = median(co, "turbo +1 co-tenant", n, key), median(s512, "turbo", n, key)
            ll, l0 = median(co, "llama.cpp +1 co-tenant", n, key), median(s512, "llama.cpp", n, key)
            row("cotenant", f"beside one controlled co-tenant (a process spinning on one CPU), bf16, {what} "
                "(in brackets: with / without it)", f"{f(t)} ({ratio(t, t0)})", f"llama.cpp {f(ll)} ({ratio(ll, l0)})",
                ratio(t, ll), reps, load)

    for step, label in (("session", "chat session, turn {}: TTFT ms, kept state / fresh prefill"),
                        ("session_server", "server prefix cache, turn {} resent whole: TTFT ms, cached / cold")):
        if text := log(step):
            r = table_rows(text)[1]
            turn, tokens = re.search(r"turn (\d+)\D+?(\d+) prompt", text).groups()
            row(step, f"{label.format(turn)} ({tokens} prompt tokens), 0.8B shape", r[0],
                f"{r[1]} (its own cold path)", r[2], *guard_of_log(text))
    return out


# ---- the output --------------------------------------------------------------------------------


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    cpus = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("CPU(s)")), "?")
    bw = [json.loads(line) for p in DIR.glob("scale*.jsonl") for line in p.read_text().splitlines()
          if '"bandwidth"' in line]
    said = (f"; read bandwidth (GEMV over 1 GB) {bw[0]['one']:.1f} GB/s on 1 thread, {bw[0]['all']:.1f} GB/s on "
            f"{bw[0]['threads']}" if bw else "")
    return f"{model}, {cpus} CPUs, no GPU{said}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    if DIR is None or not DIR.is_dir():
        raise SystemExit("usage: python -m scripts.report_vs_llamacpp DIR (scripts/measure_vs_llamacpp.py's output)")
    metas = {p.name.removesuffix(".meta.json"): json.loads(p.read_text()) for p in DIR.glob("*.meta.json")}
    metas = dict(sorted(metas.items(), key=lambda kv: kv[1]["start"]))
    if any(m.get("dry") for m in metas.values()):
        print("**DRY RUN (smallest settings, guard off): the figures below mean nothing.**\n")
    print("## (a) README, \"Measured\"\n")
    print("| what | turbo | against | ratio | reps kept / dropped | load |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for r in rows():
        print(f"| {r['what']} | {r['turbo']} | {r['against']} | {r['ratio']} | {r['reps']} | {r['load']} |")
    print("\nRatios are turbo's over the other's (tok/s) unless the cell says otherwise; reps: the quiet-machine "
          "guard's undisturbed repetitions kept / disturbed dropped (scripts/benchlib.py); load: the 1-minute "
          "load average around them. Commands, dates and commits: docs/benchmarks.md.\n")
    first_meta = next(iter(metas.values()), {})
    print("## (b) docs/benchmarks.md\n")
    print(f"## Against llama.cpp as its users run it, {first_meta.get('start', '?')[:10]}\n")
    print(f"Machine: {machine()}. llama.cpp: llama-cpp-python 0.3.36's, built by scripts/build_llamacpp.py "
          "(--no-amx: weight repacking on), its tools (llama-bench, llama-server) and the binding on the same "
          "libraries. Every step by `python -m scripts.measure_vs_llamacpp`, in this order:\n")
    for name, m in metas.items():
        ok = "" if m["rc"] == 0 else f" **(exit {m['rc']}: no figures)**"
        print(f"### {TITLES.get(name, name)}{ok}\n")
        print(f"`{m['cmd']}`  \n{m['start']} to {m['end']} ({m['seconds'] / 60:.1f} min), commit {m['commit']}"
              f"{' (+ uncommitted changes)' if m['dirty'] else ''}, load average before "
              f"{m['load_before'][0]:.2f}, after {m['load_after'][0]:.2f}\n")
        text = (DIR / f"{name}.log").read_text().strip() if m["rc"] == 0 else ""
        if text:
            print(text + "\n")
    skipped = [name for name, *_ in STEPS if not meta(name)]
    if skipped:
        print(f"Not measured (skipped, failed or not run): {', '.join(skipped)}.")


if __name__ == "__main__":
    main()
