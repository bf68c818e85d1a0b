"""llama.cpp's OpenAI-compatible server (llama-cpp-python's) on 127.0.0.1, a free port, for
scripts/bench_serve.py: prints `serving on http://127.0.0.1:PORT` on stderr once it answers.

    python scripts/llamacpp_server.py MODEL.gguf THREADS

(llama-cpp-python's server runs one request at a time: a lock around its one context.)
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import urllib.request

import uvicorn
from llama_cpp.server.app import create_app
from llama_cpp.server.settings import ModelSettings, ServerSettings


def main() -> None:
    gguf, threads = sys.argv[1], int(sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(server_settings=ServerSettings(host="127.0.0.1", port=port),
                     model_settings=[ModelSettings(model=gguf, n_threads=threads, n_threads_batch=threads,
                                                   n_ctx=2048, verbose=False)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
            break
        except OSError:
            time.sleep(0.2)
    print(f"serving on http://127.0.0.1:{port}", file=sys.stderr, flush=True)  # as turbo's task=serve
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.should_exit = True


if __name__ == "__main__":
    main()
