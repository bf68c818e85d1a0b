"""task=serve through the official `openai` client against a real server process on 127.0.0.1
(one for the module, install tiny, a ChatML template given as serve.chat_template): completions
and chat, streaming and not, stop, seed, logprobs, usage, OpenAI's errors, a client gone mid-stream,
a burst beyond the queue; the API key on the app in-process (fastapi's TestClient)."""

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import turbo  # noqa: E402
from turbo.testing.checks import served_address  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}")
PROMPT = "def fib(n):"
MAX_WAITING = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "chatml.jinja").write_text(CHATML)
    cmd = [sys.executable, "-m", "turbo", "task=serve", "serve.port=0", "threads=1", "backend=cpu",
           f"serve.chat_template={tmp / 'chatml.jinja'}", "serve.max_running=2", f"serve.max_waiting={MAX_WAITING}"]
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = served_address(proc)  # the address (stderr), once it answers
    assert line.startswith("serving on http://127.0.0.1:"), line
    url = line.split()[-1]
    yield SimpleNamespace(url=url, client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0),
                          proc=proc, template=CHATML)
    proc.send_signal(2)  # Ctrl-C: a clean stop
    assert proc.wait(timeout=30) == 130
    assert proc.stderr.read().strip().splitlines()[-1] == "interrupted"


@pytest.fixture(scope="module")
def rt():
    return turbo.open("tiny", backend="cpu", threads=1)


def complete(server, **kw):
    return server.client.completions.create(**{"model": "tiny", "prompt": PROMPT, "max_tokens": 16,
                                               "temperature": 0, **kw})


def test_completions_equal_the_runtime_streamed_or_not(server, rt):
    want = rt.generate(PROMPT, max_new_tokens=16)
    r = complete(server)
    assert r.choices[0].text == want.text and r.object == "text_completion"
    assert r.choices[0].finish_reason == want.finish.reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.stats.prompt_tokens, 16)
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(complete(server, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-2].choices[0].finish_reason == "length"
    ids = server.client.completions.create(model="tiny", prompt=rt.encode(PROMPT), max_tokens=16, temperature=0)
    assert ids.choices[0].text == want.text  # the prompt as token ids


def test_chat_equals_the_runtime_and_splits_reasoning(server, rt):
    # (a message whose 16 greedy tokens close no </think> under either bf16 product: a stream cannot
    # take back content it sent before a </think> it did not open, the whole answer can)
    messages = [{"role": "user", "content": "Write a short haiku."}]
    want = rt.chat(messages, template=server.template, max_new_tokens=16)
    r = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == want.message["content"] and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(want.prompt_tokens)
    parts = list(server.client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16,
                                                       temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == want.message["content"]
    # a template that opens <think>: an answer cut before its </think> is all reasoning
    think = dict(model="tiny", messages=messages, max_tokens=12, temperature=0,
                 extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    whole = server.client.chat.completions.create(**think).choices[0].message
    assert whole.content == "" and whole.reasoning_content
    parts = list(server.client.chat.completions.create(**think, stream=True))
    assert "".join(getattr(p.choices[0].delta, "reasoning_content", None) or "" for p in parts) == \
        whole.reasoning_content


def test_stop_and_seed(server, rt):
    text = rt.generate(PROMPT, max_new_tokens=16).text
    cut = text.strip().split()[1]
    r = complete(server, stop=[cut, "\x00never"])
    assert r.choices[0].text == text[:text.index(cut)] and r.choices[0].finish_reason == "stop"
    sampled = [complete(server, temperature=0.9, seed=7).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert rt.generate(PROMPT, max_new_tokens=16, temperature=0.9, seed=7).text == sampled[0]


def test_completions_stop_at_generation_config_eos(server):
    # tiny answers this prompt with ``` then <|im_end|>: an id its generation_config.json lists (not
    # config.json), which ends /v1/completions as it ends a chat; ignore_eos runs past it
    prompt = "class Codec(codecs.Codec):\n\n    def encode(self,input,errors='strict'):\n        return " \
             "codecs.charmap_encode(input,errors,encoding_table)\n\n    def decode(self,input,errors='strict'):\n"
    r = complete(server, prompt=prompt)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("```", "stop", 3)
    assert complete(server, prompt=prompt, extra_body={"ignore_eos": True}).usage.completion_tokens == 16


def test_logprobs(server):
    r = complete(server, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(top) == 2 and max(top.values()) >= p - 1e-4 for top, p in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == r.choices[0].text
    c = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                              temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob <= 0 for t in content)


@pytest.mark.parametrize("kw, status, param", [
    ({"model": "nope"}, 404, "model"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"max_tokens": "5"}, 400, "max_tokens"),
    ({"max_tokens": 5000}, 400, "max_tokens"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"prompt": ["one", "two"]}, 400, "prompt"),
    ({"prompt": [1, 10**9]}, 400, "prompt"),
    ({"stop": 3}, 400, "stop"),
    ({"n": 17}, 400, "n"),  # (over MAX_N)
    ({"extra_body": {"turbo": {"blok": 4}}}, 400, "turbo.blok"),
    ({"extra_body": {"turbo": {"rollback": "later"}}}, 400, "turbo.rollback"),
])
def test_errors_name_the_field(server, kw, status, param):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **kw}
    with pytest.raises(openai.APIStatusError) as e:
        server.client.completions.create(**kw)
    assert e.value.status_code == status and e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"
    assert (e.value.body["code"] == "model_not_found") == (status == 404)


def test_a_malformed_body_and_unknown_routes(server):
    for raw in (b"{bad", b"[1, 2]", b"\xff\xfe", b'{"model": "tiny", "prompt": {"x": 1}}'):
        r = httpx.post(server.url + "/v1/completions", content=raw)
        assert r.status_code == 400 and "message" in r.json()["error"], raw
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"content": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0]"
    assert httpx.get(server.url + "/v1/nothing").status_code == 404


def test_a_client_gone_mid_stream_is_freed_and_the_next_request_is_right(server, rt):
    with httpx.stream("POST", server.url + "/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True,
            "ignore_eos": True}) as r:
        lines = [line for _, line in zip(range(3), r.iter_lines()) if line]
        assert lines and json.loads(lines[0][len("data: "):])["choices"]
    assert complete(server).choices[0].text == rt.generate(PROMPT, max_new_tokens=16).text
    deadline = time.time() + 20
    while "vllm:num_requests_running{model_name=\"tiny\"} 0.0" not in httpx.get(server.url + "/metrics").text:
        assert time.time() < deadline, "the abandoned stream still runs"
        time.sleep(0.2)


def test_a_burst_past_the_queue_is_served_or_refused_never_wrong(server, rt):
    want = rt.generate(PROMPT, max_new_tokens=8).text
    burst = 4 * (MAX_WAITING + 2)

    def one(_):
        try:
            return complete(server, max_tokens=8).choices[0].text
        except openai.RateLimitError as e:
            assert e.body["code"] == "rate_limit_exceeded"
            return 429

    with ThreadPoolExecutor(burst) as pool:
        got = list(pool.map(one, range(burst)))
    assert all(g in (want, 429) for g in got), got
    assert got.count(want) >= 2 and 429 in got


def test_health_and_metrics(server):
    assert httpx.get(server.url + "/health").status_code == 200
    complete(server, max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        assert f"\n{name}{{" in text, name


def test_the_api_key():
    from fastapi.testclient import TestClient

    from turbo.serve.app import make_app

    engine = SimpleNamespace(config=SimpleNamespace(api_key="s3cret"), model="tiny", max_positions=64)
    client = TestClient(make_app(engine))
    assert client.get("/v1/models").status_code == 401
    wrong = client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).json()["data"][0]["id"] == "tiny"
    assert client.get("/health").status_code == 200  # (as vLLM: health and metrics are open)
    ok = openai.OpenAI(base_url="http://testserver/v1", api_key="s3cret", http_client=client, max_retries=0)
    assert ok.models.list().data[0].id == "tiny"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url="http://testserver/v1", api_key="bad", http_client=client, max_retries=0).models.list()


def test_bad_settings_and_a_port_in_use_are_one_line(server, tmp_path):
    port = server.url.rsplit(":", 1)[1]
    for override, says in ((f"serve.port={port}", f"serve.port={port}: cannot listen there"),
                           ("serve.engine=kubernetes", "serve.engine='kubernetes' is not one of local, ray")):
        proc = subprocess.run([sys.executable, "-m", "turbo", "task=serve", override], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr


def test_a_resent_conversation_reports_its_cached_tokens(server, rt):
    """A chat client resends the conversation: the next turn reuses the server's cached state
    (prompt_tokens_details.cached_tokens) and answers what a cold run answers."""
    messages = [{"role": "user", "content": "Explain os.path.join."}]
    first = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And os.path.split?"}]
    second = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    want = rt.chat(messages, template=server.template, max_new_tokens=12)
    assert second.choices[0].message.content == want.message["content"]
