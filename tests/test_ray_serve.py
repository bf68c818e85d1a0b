"""serve.engine=ray: a local Ray cluster, 2 replicas of the server behind Ray's HTTP proxy,
concurrent requests through the official client answered as the single-process runtime answers
(skipped where the ray extra is absent)."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

import turbo  # noqa: E402
from turbo.testing.checks import served_address  # noqa: E402

PROMPTS = ["def fib(n):", "The quick brown fox", "import numpy as np\n", "Once upon a time"]


def test_two_replicas_answer_as_one_runtime(tmp_path):
    cmd = [sys.executable, "-m", "turbo", "task=serve", "serve.engine=ray", "serve.replicas=2", "serve.port=0",
           "threads=1", "backend=cpu"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = served_address(proc)
        assert line.startswith("serving on http://127.0.0.1:") and "2 Ray Serve replicas" in line, line
        client = openai.OpenAI(base_url=line.split()[2] + "/v1", api_key="none", max_retries=0)
        ask = lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)  # noqa: E731
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = [r.choices[0].text for r in pool.map(ask, PROMPTS * 2)]
        rt = turbo.open("tiny", backend="cpu", threads=1)
        assert got == [rt.generate(p, max_new_tokens=12).text for p in PROMPTS * 2]
        assert client.models.list().data[0].id == "tiny"
    finally:
        proc.send_signal(2)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
