"""One path for every sequence (turbo/sequence/driver.py): the same requests through `Runtime.generate` and
through the server (its scheduler batching them) commit the same tokens and end for the same
reasons; the CLI and the server decide every policy / block / drafter / window case alike, since
turbo/sequence/policy.py decides for both."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")


import turbo  # noqa: E402
from turbo.__main__ import composed  # noqa: E402
from turbo.config import run_config  # noqa: E402
from turbo.errors import TurboError  # noqa: E402
from turbo.sequence.options import GenerationOptions, OpenOptions  # noqa: E402
from turbo.serve import protocol as P  # noqa: E402
from turbo.serve.settings import ServeConfig, server_defaults  # noqa: E402
from turbo.serve.worker import Engine  # noqa: E402

PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "# sort a list\n"]
# (generation options, the server's body fields for the same): greedy and seeded sampling, every
# drafter, blocks 1..8, both rollbacks, stop strings and ids, a length end
REQUESTS = [
    (dict(policy="off", stop=["file"]), dict(temperature=0, stop=["file"], turbo={"policy": "off"})),
    (dict(policy="fixed", block=4, drafter="dflash"), dict(temperature=0, turbo={"policy": "fixed", "block": 4,
                                                                                 "drafter": "dflash"})),
    (dict(policy="fixed", block=3, drafter="mtp", rollback="replay"),
     dict(temperature=0, turbo={"policy": "fixed", "block": 3, "drafter": "mtp", "rollback": "replay"})),
    (dict(policy="fixed", block=8, drafter="ngram"), dict(temperature=0, turbo={"policy": "fixed", "block": 8,
                                                                                "drafter": "ngram"})),
    (dict(policy="adaptive"), dict(temperature=0, turbo={"policy": "adaptive"})),
    (dict(policy="fixed", block=1, drafter="dflash", rollback="replay", stop_token_ids=(15,)),
     dict(temperature=0, stop_token_ids=[15], turbo={"policy": "fixed", "block": 1, "drafter": "dflash",
                                                     "rollback": "replay"})),
    (dict(temperature=0.8, seed=7, policy="fixed", block=4), dict(temperature=0.8, seed=7,
                                                                  turbo={"policy": "fixed", "block": 4})),
    (dict(temperature=1.0, top_p=0.9, seed=3, drafter="mtp", policy="fixed", block=2),
     dict(temperature=1.0, top_p=0.9, seed=3, turbo={"drafter": "mtp", "policy": "fixed", "block": 2})),
    (dict(stop=["self"]), dict(temperature=0, stop=["self"])),
    (dict(policy="fixed", block=2, drafter="dflash", max_new_tokens=5),
     dict(temperature=0, max_tokens=5, turbo={"policy": "fixed", "block": 2, "drafter": "dflash"})),
    (dict(temperature=0.7, top_k=20, seed=11, drafter="ngram", policy="fixed", block=3),
     dict(temperature=0.7, top_k=20, seed=11, turbo={"drafter": "ngram", "policy": "fixed", "block": 3})),
    (dict(policy="fixed", block=8, drafter="dflash", stop=["answer"]),
     dict(temperature=0, stop=["answer"], turbo={"policy": "fixed", "block": 8, "drafter": "dflash"})),
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tiny_server):
    assert tiny_server.engine.config.limits.max_running >= len(REQUESTS)  # all twelve in one batch
    return tiny_server.engine


def test_twelve_requests_through_generate_and_the_server_agree(engine, tiny_server):
    rt, client = engine.rt, tiny_server.client

    def served(i: int):
        body = {"max_tokens": MAX_TOKENS, **REQUESTS[i][1]}
        ext = {k: body.pop(k) for k in ("turbo", "top_k", "stop_token_ids") if k in body}
        return client.completions.create(model=engine.model, prompt=PROMPTS[i % len(PROMPTS)], logprobs=0,
                                         extra_body=ext, **body)

    with ThreadPoolExecutor(len(REQUESTS)) as pool:  # all at once: the scheduler batches them
        answers = list(pool.map(served, range(len(REQUESTS))))
    finishes = set()
    for i, ((fields, _), answer) in enumerate(zip(REQUESTS, answers)):
        alone = rt.generate(PROMPTS[i % len(PROMPTS)], **{"max_new_tokens": MAX_TOKENS, **fields})
        choice = answer.choices[0]
        pieces = [rt.decode([t]) for t in alone.tokens]
        assert choice.logprobs.tokens == pieces, i  # one entry per committed token, token for token
        assert choice.text == alone.text and answer.usage.completion_tokens == len(alone.tokens), i
        assert (choice.finish_reason, getattr(choice, "stop_reason", None)) == (alone.finish.reason,
                                                                                alone.finish.matched), i
        finishes.add((alone.finish.reason, type(alone.finish.matched).__name__))
    assert finishes == {("stop", "str"), ("stop", "int"), ("length", "NoneType")}  # every kind of end came up


# (policy, block, drafter, window) as the CLI's overrides and the server's `turbo` fields
CASES = [dict(), dict(block=4), dict(policy="off"), dict(policy="off", block=4), dict(policy="fixed", block=3),
         dict(policy="fixed"), dict(policy="adaptive"), dict(drafter="mtp"), dict(drafter="ngram", block=5),
         dict(drafter="ngram", window=8), dict(block=99), dict(policy="fixed", block=2, drafter="dflash", window=0),
         dict(drafter="dflash", window=4), dict(drafter="bogus"), dict(policy="adaptive", block=4)]


def outcome(decide) -> tuple:
    try:
        p = decide()
    except (TurboError, P.ApiError) as e:
        return "refused", str(e)
    return p.policy, p.drafter, p.block, p.off_reason


def cli_plan(rt, install: str, case: dict):
    overrides = [f"install.path={install}"] if install != "tiny" else []
    overrides += [f"+policy={v}" if k == "policy" else f"{k}={v}" for k, v in case.items()]
    cfg, problem = composed(overrides)
    assert cfg is not None, problem
    rc = run_config(cfg)
    return rt.prepare(rc.prompt, rc.generation).plan


def served_plan(engine, case: dict):
    prepared = engine.prepare(P.parse({"model": engine.model, "prompt": "def f(x):", "max_tokens": 8,
                                       "turbo": case}, chat=False))
    return engine.rt.prepare(prepared.request.ids, prepared.request.options).plan  # as the scheduler's submit


@pytest.mark.parametrize("which", ["tiny", "plain"])
def test_the_cli_and_the_server_decide_every_case_alike(which, plain_install, engine):
    if which == "tiny":
        rt, serving, install = engine.rt, engine, "tiny"
    else:
        install = str(plain_install[1])
        rt = turbo.open(install, backend="cpu", threads=1)
        serving = Engine(install, OpenOptions(backend="cpu", threads=1), server_defaults(GenerationOptions()),
                         ServeConfig())
    seen = set()
    for case in CASES:
        cli, server = outcome(lambda: cli_plan(rt, install, case)), outcome(lambda: served_plan(serving, case))
        assert cli == server, case
        seen.add(cli[0])
    # each kind of answer came up: a refusal, a plain decode and speculation
    assert "refused" in seen and "off" in seen and (which == "plain" or {"fixed", "auto", "adaptive"} <= seen)


# (GenerationOptions fields, the request's body fields): constraints and penalties beside plain
# requests in one batch
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
          "required": ["a", "b"], "additionalProperties": False}
MIXED = [
    (dict(), dict()),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
     dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})),
    (dict(repetition_penalty=1.3, policy="fixed", block=4), dict(extra={"repetition_penalty": 1.3},
                                                                 turbo={"policy": "fixed", "block": 4})),
    (dict(frequency_penalty=1.0, presence_penalty=0.5, drafter="ngram", policy="fixed", block=3),
     dict(frequency_penalty=1.0, presence_penalty=0.5, turbo={"drafter": "ngram", "policy": "fixed", "block": 3})),
    (dict(logit_bias={309: -100}, policy="fixed", block=2, drafter="mtp"),
     dict(logit_bias={"309": -100}, turbo={"policy": "fixed", "block": 2, "drafter": "mtp"})),
    (dict(response_format={"type": "regex", "regex": "[a-z]{2,6}( [a-z]{2,6}){1,4}"}, policy="fixed", block=4),
     dict(turbo={"regex": "[a-z]{2,6}( [a-z]{2,6}){1,4}", "policy": "fixed", "block": 4})),
    (dict(temperature=0.8, seed=5, presence_penalty=1.0, policy="fixed", block=3),
     dict(temperature=0.8, seed=5, presence_penalty=1.0, turbo={"policy": "fixed", "block": 3})),
    (dict(temperature=0.7, seed=9, response_format={"type": "json_object"}),
     dict(temperature=0.7, seed=9, response_format={"type": "json_object"})),
]


def test_sixteen_mixed_requests_in_one_batch_each_equal_its_solo_run(engine, tiny_server):
    rt, client = engine.rt, tiny_server.client

    def served(i: int):
        body = {"temperature": 0, "max_tokens": 32, **MIXED[i % len(MIXED)][1]}
        extra = {**body.pop("extra", {}), **{k: body.pop(k) for k in ("turbo", "response_format") if k in body}}
        return client.completions.create(model=engine.model, prompt=PROMPTS[i % len(PROMPTS)], extra_body=extra,
                                         **body)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(served, range(16)))
    for i, answer in enumerate(answers):
        fields = {"max_new_tokens": 32, **MIXED[i % len(MIXED)][0]}
        alone = rt.generate(PROMPTS[i % len(PROMPTS)], **fields)
        assert answer.choices[0].text == alone.text and answer.usage.completion_tokens == len(alone.tokens), i
        assert answer.choices[0].finish_reason == alone.finish.reason, i
