"""llama.cpp's OpenAI-compatible servers on 127.0.0.1, a free port, for scripts/bench_serve.py
and scripts/load.py: prints `serving on http://127.0.0.1:PORT` on stderr once it answers (as turbo's task=serve).

    python -m scripts.llamacpp_server MODEL.gguf THREADS --parallel N   # llama.cpp's llama-server, N slots
    python -m scripts.llamacpp_server MODEL.gguf THREADS                # llama-cpp-python's server
    python -m scripts.load --base-url http://127.0.0.1:PORT/v1 --concurrency N ...

--parallel N: llama.cpp's own `llama-server` (scripts/build_llamacpp.py builds it) with N slots
and continuous batching (its default), as llama.cpp's users serve: each slot its own
--ctx-size; threads for decode and batch alike. Without it, llama-cpp-python's server, which
runs one request at a time (a lock around its one context).
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from scripts import build_llamacpp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 300) -> None:
    """Until `url` answers 200 (llama-server's /health says 503 while it loads the model)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}) before it answered")
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url}: no answer in {timeout:.0f} s")


def start_llama_server(gguf: str, threads: int, parallel: int, ctx_per_slot: int = 2048,
                       extra: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """llama.cpp's llama-server on `gguf` with `parallel` slots, started and answering: (the
    process, its host:port). Its log is discarded (a pipe nobody reads would fill up)."""
    port = free_port()
    cmd = [str(build_llamacpp.tool("llama-server")), "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(parallel),
           "--ctx-size", str(ctx_per_slot * parallel), *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}/health", proc)
    return proc, f"127.0.0.1:{port}"


def binding_server(gguf: str, threads: int) -> None:
    """llama-cpp-python's server (its `server` extra) in this process, until interrupted."""
    import uvicorn
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    port = free_port()
    app = create_app(server_settings=ServerSettings(host="127.0.0.1", port=port),
                     model_settings=[ModelSettings(model=gguf, n_threads=threads, n_threads_batch=threads,
                                                   n_ctx=2048, verbose=False)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    wait_ready(f"http://127.0.0.1:{port}/v1/models")
    print(f"serving on http://127.0.0.1:{port}", file=sys.stderr, flush=True)  # as turbo's task=serve
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.should_exit = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("threads", type=int)
    ap.add_argument("--parallel", type=int, help="llama.cpp's llama-server with this many slots")
    ap.add_argument("--ctx-per-slot", type=int, default=2048)
    args = ap.parse_args()
    if args.parallel is None:
        return binding_server(args.gguf, args.threads)
    proc, url = start_llama_server(args.gguf, args.threads, args.parallel, args.ctx_per_slot)
    # SIGINT or SIGTERM stops the server with this process (a shell's background job ignores
    # SIGINT unless a handler is set, so set one for both)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: proc.terminate())
    print(f"serving on http://{url}", flush=True)
    proc.wait()


if __name__ == "__main__":
    main()
