"""The project's tools: benchmarks, builds, fuzzers and checks. Each runs from the repository's
root as `python -m scripts.NAME` (`--help` for its options); they import each other as
`from scripts import benchlib`. Benchmark results go to docs/results/<tool>-YYYY-MM-DD.*
(benchlib.results_path); the current tables are docs/benchmarks.md's.

    bench_attack         well-behaved clients beside hostile ones at a small vision-language server
    bench_batch          a continuous batch's trunk pass against its sequences' steps one after another
    bench_builds         the native step of two revisions of native*.c, interleaved in one process
    bench_constraints    what a JSON schema's mask and the penalties cost per decode step
    bench_formats        decode speed of installs converted from downloaded formats, beside llama.cpp
    bench_grammar_libs   llguidance against xgrammar: compile time and per-token mask time
    bench_layout_check   what the open layout's check costs at open (stat fast path, full check)
    bench_llamabench     llama.cpp's own llama-bench beside the Python binding
    bench_open           open time and peak RSS: turbo's installs against llama.cpp's GGUFs
    bench_overload       a burst of 4x the queue bound at the server: served or refused, none lost
    bench_products       one matrix product of the native step, from memory and from the caches
    bench_quant          quantized installs on the CPU: matmul paths, tokens/s, quality against bf16
    bench_round          what a speculative round costs against a decode step, and what it buys
    bench_scale          load, prefill, decode and memory at the published shapes, against llama.cpp
    bench_serve          the server's throughput under N concurrent clients, beside llama-server
    bench_session        time to first token of a chat session's later turn
    bench_tiers          turbo at each x86 ISA tier against llama.cpp built for the same tier
    bench_trees          two checkouts' whole runtime against each other, interleaved
    bench_vision         time to encode an image with the vision tower, against transformers
    benchlib             what the benchmarks share: workers, the quiet-machine guard, results files
    build_llamacpp       build llama.cpp's tools (llama-bench, llama-server) from the binding's source
    build_ptx            rebuild kernels_ptx/*.ptx from kernels_ptx/*.cu
    fuzz                 fuzz an install's files and the server's inputs, outcomes classified
    fuzz_classes         fuzz.py's classes: drafter objects, config.json fields
    fuzz_inputs          fuzz.py's classes: request bodies, GGUF tensor tables
    fuzz_requests        fuzz.py's classes: schemas, grammars, regexes, tools at depth and size
    gpu_check            the cuda backend's GPU checks in one short run
    llamacpp_server      llama.cpp's OpenAI-compatible servers on a free local port
    load                 load generator for `python -m turbo task=serve` (any OpenAI-compatible server)
    measure_vs_llamacpp  re-measure every README "Measured" figure against llama.cpp, resumable
    profile_step_many    where a continuous batch's step goes, per part
    report_vs_llamacpp   measure_vs_llamacpp's output directory as the README's and the docs' tables
    rss_figures          peak RSS by what a generation uses
    rss_grammar          the engine's resident set over many varied constrained requests
    tiny_golden          record the shipped tiny install's golden continuation
    train_tiny           train the bundled tiny model: trunk, DFlash2 drafter, MTP head

Not Python: build_tiny_install.sh (the trained tiny checkpoints into the shipped install),
check_install.sh (the package in a fresh virtual environment), bench_fp8_lookup.c (what bounds
the FP8 products on this CPU).
"""
