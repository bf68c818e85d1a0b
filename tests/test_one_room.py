"""One room per limit (issue 53): a sampling bound is written once (turbo/sequence/options.py) and
refused with the same words by the library, the CLI (a Hydra override) and the server (a 400
naming the field); the context check is one typed error (ContextTooLong, carrying its numbers)
that the library says in turbo's words and the server in OpenAI's, as it always did."""

import subprocess
import sys

import pytest

from turbo.errors import TurboError
from turbo.sequence.options import ContextTooLong, GenerationOptions
from turbo.serve.limits import context_error

PROMPT = "def fib(n):"
# (field, a value out of its bound): each refused by GenerationOptions, and by the server naming the field
OUT_OF_BOUNDS = [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("min_p", 1), ("top_k", -2),
                 ("seed", -1), ("repetition_penalty", 0), ("frequency_penalty", 3), ("presence_penalty", -2.5),
                 ("logit_bias", {"5": 500}), ("stop", "")]


def library_error(name: str, value: object) -> str:
    with pytest.raises(TurboError) as e:
        GenerationOptions(**{name: value})
    assert e.value.field == name
    return str(e.value)


def test_a_sampling_bound_is_the_same_error_from_the_library_the_cli_and_the_server(tmp_path, tiny_server):
    said = library_error("top_p", 0)
    assert said == "top_p is 0, expected a number in (0, 1]"
    cmd = [sys.executable, "-m", "turbo", f"hydra.run.dir={tmp_path}/hydra", "threads=1", "backend=cpu",
           "prompt=hi", "max_new_tokens=2", "top_p=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {said}", proc.stderr
    r = tiny_server.http.post("/v1/completions", json={"model": tiny_server.engine.model, "prompt": PROMPT,
                                                        "max_tokens": 2, "top_p": 0})
    assert r.status_code == 400 and r.json()["error"] == {"message": said, "type": "invalid_request_error",
                                                           "param": "top_p", "code": None}, r.json()


@pytest.mark.parametrize("name, value", OUT_OF_BOUNDS)
def test_the_server_refuses_each_bound_with_the_option_types_words(tiny_server, name, value):
    said = library_error(name, value)
    r = tiny_server.http.post("/v1/completions", json={"model": tiny_server.engine.model, "prompt": PROMPT,
                                                        "max_tokens": 2, name: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.json()
    assert r.json()["error"]["message"] == said


@pytest.mark.parametrize("body, param, says", [
    ({"max_tokens": 0}, "max_tokens", "max_tokens is 0, expected a positive integer"),
    ({"n": 17}, "n", "n is 17, expected an integer from 1 to 16"),
    ({"logprobs": 21}, "logprobs", "logprobs is 21, expected an integer in 0..20"),
])
def test_counts_are_refused_by_the_one_check_spelled_as_the_request_spells_the_field(tiny_server, body, param,
                                                                                     says):
    r = tiny_server.http.post("/v1/completions", json={"model": tiny_server.engine.model, "prompt": PROMPT,
                                                        "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
    assert r.json()["error"]["message"].startswith(says), r.json()


def test_the_context_check_is_one_typed_error(tiny_server):
    rt = tiny_server.engine.rt
    limit, n = rt.install.arch.max_positions, len(rt.encode(PROMPT))
    with pytest.raises(ContextTooLong) as e:
        rt.generate(PROMPT, max_new_tokens=limit)
    assert (e.value.prompt_tokens, e.value.max_new_tokens, e.value.limit) == (n, limit, limit)
    assert isinstance(e.value, TurboError) and f"max_position_embeddings {limit}" in str(e.value)


def test_the_server_renders_it_in_openais_words_as_before(tiny_server):
    model, limit = tiny_server.engine.model, tiny_server.engine.max_positions
    n = len(tiny_server.engine.rt.encode(PROMPT))
    r = tiny_server.http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": limit})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": f"This model's maximum context length is {limit} tokens. However, you requested {n + limit} "
                   f"tokens ({n} in the prompt, {limit} for the completion). Please reduce the length of the prompt "
                   "or the completion.", "type": "invalid_request_error", "param": "max_tokens", "code": None}
    # no max_tokens: the room the prompt leaves; a prompt that fills the context is refused naming it
    long = " ".join(["word"] * (limit + 8))
    r = tiny_server.http.post("/v1/completions", json={"model": model, "prompt": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.json()
    assert r.json()["error"]["message"].startswith(f"This model's maximum context length is {limit} tokens.")
    assert tiny_server.http.post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                                           "max_tokens": 2}).status_code == 200
    e = context_error(ContextTooLong(10, 5, 12), "messages", "max_completion_tokens")
    assert (e.status, e.param) == (400, "max_completion_tokens") and "(10 in the messages, 5 for" in e.message
    assert context_error(ContextTooLong(10, 5, 12), "messages", None).param == "messages"



def test_the_settings_check_themselves_where_they_are_built():
    """ServeConfig, ServeLimits and the probe's settings refuse a bad field whoever builds them
    (serve_config and the probe read the config; the API and the tests build them directly)."""
    from turbo.probe import ProbeSettings
    from turbo.serve.settings import ServeConfig, ServeLimits

    for build, says in ((lambda: ServeConfig(port=70000), "serve.port=70000, expected an integer >= 0 and <= 65535"),
                        (lambda: ServeConfig(engine="kubernetes"), "serve.engine='kubernetes' is not one of"),
                        (lambda: ServeLimits(memory_gb=0), "serve.memory_gb=0, expected a number of GB > 0"),
                        (lambda: ServeLimits(max_running=0), "serve.max_running=0, expected an integer >= 1"),
                        (lambda: ProbeSettings(blocks=(2, "x")), "probe.blocks: 'x' is not an integer"),
                        (lambda: ProbeSettings(prompts_per_workload=0), "probe.prompts_per_workload=0, expected"),
                        (lambda: ProbeSettings(past_eos="yes"), "probe.past_eos='yes', expected true or false")):
        with pytest.raises(TurboError) as e:
            build()
        assert says in str(e.value), str(e.value)
    assert ServeConfig().limits == ServeLimits() and ProbeSettings().blocks == (1, 2, 4, 7, 8)
