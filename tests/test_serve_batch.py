"""The server with several requests generating at once (``--max-batch``, BatchEngine).

Concurrent clients of every method get exactly what ``generate`` gives each of them alone
(float64 tiny pair, greedy, stop strings, streamed or not); a cancelled stream leaves the others
running; the queue bound counts the batch; a transformers-runtime generator is refused.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from caddtree import InvalidInputError, SpeculativeGenerator  # noqa: E402
from caddtree.serve import build_app  # noqa: E402
from test_serve import Server, chat_stream_text, client, metrics, post  # noqa: E402

MODEL = "tiny-batched"
METHODS = [("ar", {}), ("ddtree", {"budget": 6}), ("caddtree", {}), ("dflash", {})]


@pytest.fixture(scope="module")
def served(tiny_pair_dirs, cost_file):
    target, draft = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(
        target, draft, dtype="float64", device="cpu", cost_model=cost_file
    )
    slow = {"s": 0.0}
    app = build_app(
        gen,
        model_name=MODEL,
        method="caddtree",
        max_new_tokens=16,
        max_queue=4,  # with 3 generating, every one of the 6 concurrent requests is taken
        max_batch=3,
        cost_model_dir=Path(cost_file).parent,
    )
    engine = app.state.engine
    server = Server(app)
    server.slow, server.batch_sizes = slow, []

    def each_round(_job):
        server.batch_sizes.append(engine.running)
        time.sleep(slow["s"])

    engine.on_round = each_round
    yield server
    server.stop()


PROMPTS = ["hello there", "the cat sat", "one two three", "a b c d", "zzz", "why?"]


def ask(server, prompt: str, method: str, extra: dict, stream: bool) -> tuple[str, str]:
    c = client(server)
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=14,
        temperature=0,
        extra_body={"method": method, **extra},
    )
    if stream:
        text, finish, _ = chat_stream_text(c.chat.completions.create(stream=True, **kwargs))
        return text, finish
    resp = c.chat.completions.create(**kwargs)
    return resp.choices[0].message.content, resp.choices[0].finish_reason


def test_concurrent_requests_get_what_generate_gives_each_alone(served, reference):
    jobs = [(prompt, *METHODS[i % len(METHODS)], i % 2 == 1) for i, prompt in enumerate(PROMPTS)]
    before = metrics(served)
    served.batch_sizes.clear()
    served.slow["s"] = 0.02  # rounds slow enough that the requests overlap on a busy machine
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda j: ask(served, *j), jobs))
    finally:
        served.slow["s"] = 0.0
    assert max(served.batch_sizes) == 3  # requests really generated together
    for (prompt, method, extra, _), (text, finish) in zip(jobs, answers):
        want = reference.generate(
            [{"role": "user", "content": prompt}], method=method, max_new_tokens=14, **extra
        )
        assert text == want.text, (prompt, method)
        assert finish == ("length" if len(want.token_ids) == 14 else "stop")
    after = metrics(served)
    done = "caddtree:request_success_total"
    assert sum(v for k, v in after.items() if k.startswith(done)) - sum(
        v for k, v in before.items() if k.startswith(done)
    ) == len(jobs)


def test_stop_strings_and_a_cancelled_stream_in_the_batch(served, reference):
    messages = [{"role": "user", "content": "hello there"}]
    free = reference.generate(messages, method="ar", max_new_tokens=14, stop_token_ids=()).text
    stop = free[3:5]
    want = reference.generate(messages, method="ddtree", budget=6, max_new_tokens=14, stop=[stop])
    served.slow["s"] = 0.02
    try:
        c = client(served)
        stream = c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=14,
            temperature=0,
            stream=True,
            extra_body={"method": "ar", "ignore_eos": True},
        )
        next(iter(stream))
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(
                lambda: c.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=14,
                    temperature=0,
                    stop=[stop],
                    extra_body={"method": "ddtree", "budget": 6},
                )
            )
            stream.close()  # the client goes away mid-stream
            resp = other.result(60)
    finally:
        served.slow["s"] = 0.0
    assert resp.choices[0].message.content == want.text.split(stop)[0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = json.loads(urllib.request.urlopen(served.base + "/health").read())
        if health["running"] == 0:
            break
        time.sleep(0.05)
    assert health["running"] == 0  # the cancelled stream left the batch


def test_a_batch_needs_the_lean_runtime(tiny_pair_dirs):
    target, _ = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(
        target, None, dtype="float64", device="cpu", runtime="transformers"
    )
    with pytest.raises(InvalidInputError, match="needs the lean runtime"):
        build_app(gen, model_name=MODEL, max_batch=2)
    status, _, reply = post_ok(tiny_pair_dirs)
    assert status == 200 and reply["choices"][0]["text"]


def post_ok(tiny_pair_dirs):
    """A plain completion through a batched server on the lean runtime (the default)."""
    target, _ = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(target, None, dtype="float64", device="cpu")
    server = Server(build_app(gen, model_name=MODEL, method="ar", max_batch=2))
    try:
        return post(server, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 4}))
    finally:
        server.stop()


def test_caddtree_requests_share_a_joint_budget_unless_told_not_to(tiny_pair_dirs, cost_file):
    target, draft = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(
        target, draft, dtype="float64", device="cpu", cost_model=cost_file
    )
    joint = build_app(gen, model_name=MODEL, max_batch=2).state.engine
    alone = build_app(gen, model_name=MODEL, max_batch=2, batch_budget="per-request").state.engine
    try:
        assert joint.decoder.joint_cost_model is gen.cost_model
        assert alone.decoder.joint_cost_model is None
    finally:
        joint.stop()
        alone.stop()
