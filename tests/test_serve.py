"""`caddtree serve`: the real server (uvicorn on a free port, in a thread) and the openai client.

One server for the module, on the tiny float64 pair; a per-round delay (the app's ``on_round``
test hook) makes generation slow where a test needs requests to overlap.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from caddtree import SpeculativeGenerator  # noqa: E402
from caddtree.serve import build_app, main  # noqa: E402
from caddtree.util.errors import MissingDependencyError  # noqa: E402

MODEL = "tiny-qwen3"
MAX_QUEUE = 4


class Server:
    """uvicorn serving ``app`` on a free localhost port, in a background thread."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


@pytest.fixture(scope="module")
def delay():
    return {"s": 0.0}


@pytest.fixture(scope="module")
def served(tiny_pair_dirs, cost_file, delay):
    target, draft = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(
        target, draft, dtype="float64", device="cpu", cost_model=cost_file
    )

    def slow_down(_job):
        if delay["s"]:
            time.sleep(delay["s"])

    app = build_app(
        gen,
        model_name=MODEL,
        method="caddtree",
        budget=8,
        max_new_tokens=16,
        max_queue=MAX_QUEUE,
        on_round=slow_down,
        cost_model_dir=Path(cost_file).parent,
    )
    server = Server(app)
    yield server
    server.stop()


@pytest.fixture
def slow(delay):
    delay["s"] = 0.05
    yield
    delay["s"] = 0.0


def client(server, **kwargs):
    return openai.OpenAI(
        base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=30, **kwargs
    )


def metrics(server) -> dict[str, float]:
    """``/metrics`` as {sample name with labels, model_name dropped: value}."""
    with urllib.request.urlopen(server.base + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")
        out[name] = float(value)
    return out


def post(server, path, body: bytes | str, content_type="application/json"):
    """(status, headers, parsed JSON) of a raw POST."""
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(
        server.base + path, data=data, headers={"Content-Type": content_type}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read())


def chat_stream_text(stream) -> tuple[str, str, dict]:
    """(text, finish_reason, caddtree stats) of a streamed chat completion."""
    parts, finish, stats = [], None, None
    for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            parts.append(choice.delta.content or "")
            if choice.finish_reason:
                finish = choice.finish_reason
                stats = chunk.model_extra.get("caddtree")
    return "".join(parts), finish, stats


# ---- outputs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "extra"),
    [("ar", {}), ("ddtree", {"budget": 8}), ("caddtree", {}), ("dflash", {})],
)
def test_outputs_equal_generate(served, reference, method, extra):
    c = client(served)
    body = {"method": method, **extra}
    messages = [{"role": "user", "content": "hello there"}]
    want = reference.generate(messages, method=method, max_new_tokens=12, **extra)
    assert want.text  # the comparison below means something

    resp = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=body
    )
    assert resp.object == "chat.completion" and resp.model == MODEL
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].finish_reason == ("length" if len(want.token_ids) == 12 else "stop")
    assert resp.usage.prompt_tokens == len(want.prompt_ids)
    assert resp.usage.completion_tokens == len(want.token_ids)
    assert resp.usage.total_tokens == len(want.prompt_ids) + len(want.token_ids)
    stats = resp.model_extra["caddtree"]
    assert stats["method"] == method and stats["new_tokens"] == len(want.token_ids)
    for key in ("tau", "ms_per_token", "rounds", "budget_mean", "queue_time_s"):
        assert isinstance(stats[key], (int, float)), key

    stream = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=body,
    )
    usage = None
    parts, finish = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == want.text
    assert finish == resp.choices[0].finish_reason
    assert usage.completion_tokens == len(want.token_ids)

    prompt = "once upon a time"
    want = reference.generate(prompt, method=method, chat=False, max_new_tokens=10, **extra)
    resp = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body=body
    )
    assert resp.object == "text_completion"
    assert resp.choices[0].text == want.text
    assert resp.usage.completion_tokens == len(want.token_ids)
    pieces = [
        chunk.choices[0].text
        for chunk in c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True, extra_body=body
        )
        if chunk.choices
    ]
    assert "".join(pieces) == want.text
    # token ids as the prompt
    resp = c.completions.create(
        model=MODEL, prompt=want.prompt_ids, max_tokens=10, temperature=0, extra_body=body
    )
    assert resp.choices[0].text == want.text


def test_server_defaults_and_request_cost_model(served, reference, cost_file):
    """No method: the server's (caddtree, with its cost model); a cost-model file per request;
    a seeded sample is reproducible."""
    c = client(served)
    want = reference.generate("abc", method="ar", chat=False, max_new_tokens=16)
    resp = c.completions.create(model=MODEL, prompt="abc", temperature=0)  # max_tokens: 16
    assert resp.model_extra["caddtree"]["method"] == "caddtree"
    assert resp.choices[0].text == want.text
    resp = c.completions.create(
        model=MODEL, prompt="abc", temperature=0, extra_body={"cost_model": "cost.json"}
    )
    assert resp.choices[0].text == want.text
    sampled = [
        c.completions.create(model=MODEL, prompt="abc", seed=3, extra_body={"method": "ar"})
        for _ in range(2)
    ]
    assert sampled[0].choices[0].text == sampled[1].choices[0].text


def test_sampling_extras_and_stop_strings(served, reference):
    c = client(served)
    messages = [{"role": "user", "content": "count"}]
    greedy = reference.generate(messages, method="ar", max_new_tokens=12)
    # top_k=1 samples the argmax: greedy decoding's output at any temperature
    resp = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=1.5,
        extra_body={"top_k": 1, "min_p": 0.01, "method": "ddtree", "budget": 4},
    )
    assert resp.choices[0].message.content == greedy.text
    want = reference.generate(messages, method="ar", max_new_tokens=12, repetition_penalty=1.3)
    resp = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"repetition_penalty": 1.3, "method": "caddtree"},
    )
    assert resp.choices[0].message.content == want.text
    # a stop string cuts the answer before it, streamed or not
    stop = greedy.text[3:5]
    expected = greedy.text[: greedy.text.find(stop)]
    resp = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stop=[stop, "zzzz"]
    )
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stop=stop, stream=True
    )
    text, finish, _ = chat_stream_text(stream)
    assert (text, finish) == (expected, "stop")
    # chat_template_kwargs reach the template (the tiny one ignores them)
    resp = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"method": "ar", "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert resp.choices[0].message.content == greedy.text


# ---- the other endpoints -------------------------------------------------------------------------------


def test_a_request_may_take_copies_from_its_context(served):
    """``lookup``: copies from the context join a caddtree request's trees (the same text at
    temperature 0), counted in the response's statistics and in /metrics; ``method: lookup``
    decodes with copies alone; a lookup the method cannot take is a 400 naming the field."""
    c = client(served)
    messages = [{"role": "user", "content": "ab ab ab"}]
    texts, stats = [], []
    before = metrics(served)
    for extra in ({}, {"lookup": True}, {"method": "lookup", "lookup": False}):
        resp = c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=30,
            temperature=0,
            extra_body={"method": "caddtree", "ignore_eos": True, **extra},
        )
        texts.append(resp.choices[0].message.content)
        stats.append(resp.model_extra["caddtree"])
    after = metrics(served)
    assert texts[1] == texts[0] == texts[2]
    assert stats[0]["copied_tokens"] == 0 and stats[1]["copied_accepted_tokens"] > 0
    assert stats[2]["method"] == "lookup" and stats[2]["tau"] > 1
    copied = sum(s["copied_accepted_tokens"] for s in stats)
    moved = [
        after[f'caddtree:copied_accepted_tokens_total{{method="{m}"}}']
        - before.get(f'caddtree:copied_accepted_tokens_total{{method="{m}"}}', 0.0)
        for m in ("caddtree", "lookup")
    ]
    assert sum(moved) == copied
    for extra, message in (
        ({"method": "dflash", "lookup": True}, "not of 'dflash'"),
        ({"method": "caddtree", "lookup": "yes"}, "lookup must be true or false"),
    ):
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}
        status, _, answer = post(served, "/v1/chat/completions", json.dumps(body))
        assert status == 400 and answer["error"]["param"] == "lookup"
        assert message in answer["error"]["message"]


def test_models_health_and_metrics(served):
    c = client(served)
    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]
    with urllib.request.urlopen(served.base + "/health", timeout=10) as resp:
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"

    before = metrics(served)
    for method in ("ar", "dflash", "ddtree", "caddtree"):  # every method shown from the start
        assert f'caddtree:num_rounds_total{{method="{method}"}}' in before
    assert (
        'caddtree:spec_decode_num_accepted_tokens_per_pos_total{method="ddtree",position="0"}'
        in before
    )
    resp = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "metrics please"}],
        max_tokens=12,
        temperature=0,
        extra_body={"method": "ddtree", "budget": 8, "ignore_eos": True},
    )
    after = metrics(served)
    stats = resp.model_extra["caddtree"]
    assert resp.usage.completion_tokens == 12

    def moved(name):
        return after[name] - before.get(name, 0.0)

    assert moved('caddtree:request_success_total{finished_reason="length"}') == 1
    assert moved("caddtree:prompt_tokens_total") == resp.usage.prompt_tokens
    assert moved("caddtree:generation_tokens_total") == 12
    ddtree = '{method="ddtree"}'
    assert moved("caddtree:num_rounds_total" + ddtree) == stats["rounds"]
    assert moved('caddtree:num_rounds_total{method="caddtree"}') == 0  # another method's
    drafts = moved("caddtree:spec_decode_num_drafts_total" + ddtree)
    assert 1 <= drafts <= stats["rounds"]
    assert moved("caddtree:spec_decode_num_draft_tokens_total" + ddtree) <= 8 * drafts
    accepted = moved("caddtree:spec_decode_num_accepted_tokens_total" + ddtree)
    # every round commits its accepted tokens plus one (the last round may be cut by max_tokens)
    assert accepted >= 12 - 1 - stats["rounds"]
    per_pos = [
        moved(
            "caddtree:spec_decode_num_accepted_tokens_per_pos_total"
            f'{{method="ddtree",position="{p}"}}'
        )
        for p in range(5)  # the tiny drafter's block is 6: positions 0..4
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert after["caddtree:time_to_first_token_seconds_count"] >= 1
    assert (
        after['caddtree:time_to_first_token_seconds_bucket{le="+Inf"}']
        == after["caddtree:time_to_first_token_seconds_count"]
    )
    assert after["caddtree:e2e_request_latency_seconds_count"] >= 1
    assert after["caddtree:num_requests_running"] == 0
    assert after["caddtree:num_requests_waiting"] == 0
    assert after["caddtree:mean_acceptance_length" + ddtree] >= 1
    assert 0 <= after["caddtree:draft_acceptance_rate" + ddtree] <= 1
    assert after["caddtree:mean_tree_budget" + ddtree] > 0
    # one inter-token gap per round after the first output; one time per output token per request
    assert moved("caddtree:inter_token_latency_seconds_count") == stats["rounds"]
    assert moved("caddtree:request_time_per_output_token_seconds_count") == 1
    tpot = moved("caddtree:request_time_per_output_token_seconds_sum")
    assert 0 < tpot < moved("caddtree:e2e_request_latency_seconds_sum")
    assert after["caddtree:decode_tokens_per_second"] > 0
    with urllib.request.urlopen(served.base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for name in ("mean_acceptance_length", "draft_acceptance_rate", "mean_tree_budget"):
        assert f"# HELP caddtree:{name} " in text and f"# TYPE caddtree:{name} gauge" in text


# ---- load ---------------------------------------------------------------------------------------------

PROMPTS = ["alpha", "bravo charlie", "delta", "echo fox", "golf", "hotel india", "juliet"]


def _ask(server, prompt, max_tokens=8):
    return client(server).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"method": "ddtree", "budget": 4},
    )


def test_burst_within_the_queue_bound(served, reference):
    prompts = PROMPTS[:MAX_QUEUE]
    want = {
        p: reference.generate(p, method="ar", chat=False, max_new_tokens=8).text for p in prompts
    }
    assert len(set(want.values())) > 1
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = dict(zip(prompts, pool.map(lambda p: _ask(served, p).choices[0].text, prompts)))
    assert got == want


def test_burst_beyond_the_queue_bound_gets_503(served, reference, slow):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(3 * (MAX_QUEUE + 1))]
    want = {
        p: reference.generate(p, method="ar", chat=False, max_new_tokens=6).text
        for p in set(prompts)
    }
    before = metrics(served)
    clients = [client(served) for _ in prompts]
    barrier = threading.Barrier(len(prompts))

    def ask(i):
        barrier.wait()  # all at once
        try:
            resp = clients[i].completions.create(
                model=MODEL,
                prompt=prompts[i],
                max_tokens=6,
                temperature=0,
                extra_body={"method": "ddtree", "budget": 4},
            )
            return prompts[i], resp.choices[0].text
        except openai.APIStatusError as err:
            return prompts[i], err

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(ask, range(len(prompts))))
    refused = [r for _, r in results if isinstance(r, Exception)]
    answered = [(p, r) for p, r in results if not isinstance(r, Exception)]
    assert refused and len(answered) >= MAX_QUEUE + 1
    for err in refused:
        assert err.status_code == 503
        assert int(err.response.headers["Retry-After"]) >= 1
        assert err.body["code"] == "queue_full" and err.body["message"]
    assert all(text == want[p] for p, text in answered)
    after = metrics(served)
    assert after["caddtree:num_requests_rejected_total"] - before.get(
        "caddtree:num_requests_rejected_total", 0
    ) == len(refused)


def test_disconnect_mid_stream_cancels_the_generation(served, reference, slow):
    before = metrics(served)
    c = client(served)
    stream = c.completions.create(
        model=MODEL,
        prompt="a long one",
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"method": "ar", "ignore_eos": True},  # 40 rounds of 50 ms if not cancelled
    )
    first = next(iter(stream))
    assert first.choices
    stream.close()
    start = time.monotonic()
    resp = _ask(served, "next please", max_tokens=4)
    assert time.monotonic() - start < 1.5  # it did not wait for the other one's 40 rounds
    assert (
        resp.choices[0].text
        == reference.generate("next please", method="ar", chat=False, max_new_tokens=4).text
    )
    deadline = time.monotonic() + 5
    while True:
        after = metrics(served)
        aborted = after['caddtree:request_success_total{finished_reason="abort"}'] - before.get(
            'caddtree:request_success_total{finished_reason="abort"}', 0
        )
        if aborted == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert aborted == 1
    generated = (
        after["caddtree:generation_tokens_total"] - before["caddtree:generation_tokens_total"]
    )
    assert generated - resp.usage.completion_tokens < 20  # the cancelled one stopped early


def test_disconnect_while_waiting_for_a_plain_response_cancels(served, slow):
    """A non-streaming client that hangs up is noticed too (polled while its job runs)."""
    before = metrics(served)
    body = json.dumps(
        {"prompt": "hang up", "max_tokens": 40, "method": "ar", "ignore_eos": True}
    ).encode()
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.3)
    start = time.monotonic()
    _ask(served, "after the hang-up", max_tokens=4)
    assert time.monotonic() - start < 1.5
    key = 'caddtree:request_success_total{finished_reason="abort"}'
    assert metrics(served)[key] - before.get(key, 0) == 1


def test_queue_bound_counts_the_running_request():
    """max_queue requests wait behind the running one; max_queue=0 serves one at a time."""
    import asyncio

    from caddtree.serve.metrics import ServerMetrics
    from caddtree.serve.worker import Engine, Job, QueueFull

    release = threading.Event()

    class Blocking:
        tokenizer = None

        def generate(self, prompt_ids, callback, **kwargs):
            callback(None, [1])
            release.wait(10)
            raise RuntimeError("released")

    async def scenario(max_queue):
        engine = Engine(Blocking(), ServerMetrics("m"), max_queue=max_queue)
        engine.start()
        try:
            jobs = [Job([1], {}) for _ in range(max_queue + 2)]
            engine.submit(jobs[0])
            assert (await jobs[0].events.get())[0] == "start"  # running now
            for job in jobs[1:-1]:
                engine.submit(job)
            with pytest.raises(QueueFull):
                engine.submit(jobs[-1])
            assert (engine.running, engine.waiting) == (1, max_queue)
            engine.cancel(jobs[1] if max_queue else jobs[0])
        finally:
            release.set()
            await asyncio.to_thread(engine.stop)
            release.clear()

    asyncio.run(scenario(0))
    asyncio.run(scenario(2))


# ---- errors ---------------------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", "{not json", None),
        ("/v1/chat/completions", "[1, 2]", None),
        ("/v1/chat/completions", {"model": MODEL}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "method": "beam"}, "method"),
        ("/v1/chat/completions", {**CHAT, "method": "ddtree", "budget": -3}, "budget"),
        ("/v1/chat/completions", {**CHAT, "method": "ar", "budget": 4}, "budget"),
        ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {**CHAT, "n": 2}, "n"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "stop": 5}, "stop"),
        ("/v1/chat/completions", {**CHAT, "seed": "x"}, "seed"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ("/v1/chat/completions", {**CHAT, "top_k": -5}, "top_k"),
        ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/chat/completions", {**CHAT, "method": "ar", "max_budget": 9}, "max_budget"),
        ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, None),
        ("/v1/completions", {"prompt": "x" * 80}, "prompt"),  # the tiny model's context is 64
        ("/v1/completions", {"prompt": "hello", "max_tokens": 60}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "cost_model": "no-such-cost.json"}, "cost_model"),
        # requests read cost models only from the server's --cost-model-dir
        ("/v1/completions", {"prompt": "hi", "cost_model": "/etc/passwd"}, "cost_model"),
        ("/v1/completions", {"prompt": "hi", "cost_model": "../../cost.json"}, "cost_model"),
        ("/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt"),
    ],
)
def test_bad_requests_get_400(served, path, body, param):
    raw = body if isinstance(body, str) else json.dumps(body)
    status, _, reply = post(served, path, raw)
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(
    ("message", "param", "says"),
    [
        ({"role": "wizard", "content": "hi"}, "messages", ["'wizard'", '"user"', '"system"']),
        ({"role": "developer", "content": "hi"}, "messages", ["'developer'", '"user"']),
        ({"role": "user", "content": None}, "messages[1].content", ["null", "as a string"]),
        ({"role": "user"}, "messages[1].content", ["no content", "as a string"]),
    ],
)
def test_unknown_roles_and_null_content_get_400_saying_what_to_send(served, message, param, says):
    body = {**CHAT, "messages": [{"role": "system", "content": "be brief"}, message]}
    status, _, reply = post(served, "/v1/chat/completions", json.dumps(body))
    assert status == 400, reply
    assert reply["error"]["param"] == param
    for words in says:
        assert words in reply["error"]["message"], reply


def test_tool_and_developer_roles_are_taken_where_the_template_names_them():
    from caddtree.engine.tokens import check_chat_roles, template_roles
    from caddtree.util.errors import InvalidInputError

    class Tokenizer:
        chat_template = "{% if m['role'] == 'tool' %}<tool>{% endif %}"

    assert template_roles(Tokenizer()) == ("system", "user", "assistant", "tool")
    check_chat_roles(Tokenizer(), [{"role": "tool", "content": "42"}])
    with pytest.raises(InvalidInputError, match="'developer'"):
        check_chat_roles(Tokenizer(), [{"role": "developer", "content": "hi"}])
    Tokenizer.chat_template = {"default": 'role == "developer"', "tool_use": "'tool'"}
    assert template_roles(Tokenizer()) == ("system", "user", "assistant", "tool", "developer")


# ---- three holes found by probing (issue 32) -------------------------------------------------------


def test_deeply_nested_json_is_a_400_not_a_recursion_error(served, caplog):
    depth = 100_000
    with caplog.at_level("ERROR"):
        status, _, reply = post(served, "/v1/chat/completions", "[" * depth + "]" * depth)
    assert status == 400, reply
    assert "nests" in reply["error"]["message"]
    assert "RecursionError" not in caplog.text and "Traceback" not in caplog.text


def test_stop_lists_are_capped_and_cost_memory_of_the_strings_only(served, reference):
    from caddtree.engine.decoding import StopStrings
    from caddtree.util.checks import MAX_STOP_STRINGS

    many = [f"never{i}" for i in range(MAX_STOP_STRINGS + 1)]
    status, _, reply = post(served, "/v1/chat/completions", json.dumps({**CHAT, "stop": many}))
    assert status == 400 and reply["error"]["param"] == "stop"
    assert f"at most {MAX_STOP_STRINGS}" in reply["error"]["message"]
    status, _, reply = post(
        served, "/v1/completions", json.dumps({"prompt": "hi", "stop": ["x" * 600]})
    )
    assert status == 400 and reply["error"]["param"] == "stop"
    # the criterion keeps the strings and a window of tokens: nothing the size of the vocabulary
    criterion = StopStrings(reference.tokenizer, many[:MAX_STOP_STRINGS])
    assert criterion.window == max(len(s) for s in many) + 2
    assert set(vars(criterion)) == {"tokenizer", "stops", "window"}
    # the full list the server takes still answers at once, and stops where it should
    c = client(served)
    resp = c.completions.create(
        model=MODEL,
        prompt="hello there",
        max_tokens=12,
        temperature=0,
        stop=many[: MAX_STOP_STRINGS - 1] + ["e"],
        extra_body={"method": "ar"},
    )
    assert "e" not in resp.choices[0].text and resp.choices[0].finish_reason in ("stop", "length")


def test_a_huge_body_gets_413_and_a_long_prompt_does_not_stall_health(tiny_pair_dirs, monkeypatch):
    target, _ = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(target, None, dtype="float64", device="cpu")
    app = build_app(gen, model_name=MODEL, method="ar", max_request_bytes=10_000)
    server = Server(app)
    entered, release = threading.Event(), threading.Event()
    try:
        body = json.dumps({"prompt": "x" * 20_000})
        status, _, reply = post(server, "/v1/completions", body)
        assert status == 413 and "10,000 bytes" in reply["error"]["message"]
        # tokenising happens off the event loop: a slow tokenizer leaves /health answering
        original = gen.encode

        def slow_encode(*args, **kwargs):
            entered.set()
            release.wait(10)
            return original(*args, **kwargs)

        monkeypatch.setattr(gen, "encode", slow_encode)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, server, "/v1/completions", json.dumps({"prompt": "hi"}))
            assert entered.wait(10)
            started = time.monotonic()
            with urllib.request.urlopen(server.base + "/health", timeout=5) as resp:
                assert resp.status == 200
            assert time.monotonic() - started < 2
            release.set()
            assert pending.result(30)[0] == 200
    finally:
        release.set()
        server.stop()


def test_errors_through_the_client_and_the_server_stays_up(served):
    c = client(served)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=MODEL, messages=CHAT["messages"], n=2)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=CHAT["messages"])
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(
            model=MODEL, messages=CHAT["messages"], stream=True, extra_body={"method": "nope"}
        )
    assert "unknown method" in info.value.body["message"]
    status, _, reply = post(served, "/v1/nowhere", "{}")
    assert status == 404 and reply["error"]["message"]
    # and it still answers
    resp = c.chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=3, extra_body={"method": "ar"}
    )
    assert resp.usage.completion_tokens >= 1


def test_unexpected_errors_are_500_and_the_server_stays_up(tiny_pair_dirs):
    target, _ = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(target, None, dtype="float64", device="cpu")

    def broken(*args, **kwargs):
        raise RuntimeError("the GPU caught fire")

    good = gen.generate
    gen.generate = broken
    server = Server(build_app(gen, model_name=MODEL, method="ar"))
    try:
        status, _, reply = post(server, "/v1/completions", json.dumps({"prompt": "hi"}))
        assert status == 500 and reply["error"]["type"] == "server_error"
        assert "caught fire" in reply["error"]["message"]
        gen.generate = good
        status, _, reply = post(server, "/v1/completions", json.dumps({"prompt": "hi"}))
        assert status == 200 and reply["choices"][0]["text"] is not None
        # no drafter: speculative methods are a 400
        status, _, reply = post(
            server, "/v1/completions", json.dumps({"prompt": "hi", "method": "dflash"})
        )
        assert status == 400 and "drafter" in reply["error"]["message"]
    finally:
        server.stop()


# ---- the package and the command ------------------------------------------------------------------------


def test_import_without_fastapi_says_how_to_install(monkeypatch):
    for name in list(sys.modules):
        if name == "caddtree.serve" or name.startswith("caddtree.serve."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'caddtree\[serve\]'"):
        import caddtree.serve  # noqa: F401


def test_main_reports_a_busy_port(capsys, tiny_pair_dirs):
    target, draft = tiny_pair_dirs
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["--target", str(target), "--draft", str(draft), "--port", str(port)]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("caddtree: error: cannot listen on 127.0.0.1:") and "Traceback" not in err
    assert main(["--target", str(target), "--max-queue", "-1"]) == 2
    assert "--method caddtree needs --draft" in capsys.readouterr().err


def test_main_serves_until_interrupted(tiny_pair_dirs, cost_file):
    target, draft = tiny_pair_dirs
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "caddtree.serve", "--target", str(target), "--draft", str(draft)]
    cmd += ["--dtype", "float64", "--device", "cpu", "--port", "0", "--cost-model", cost_file]
    cmd += ["--served-model-name", MODEL, "--log-level", "warning", "--max-new-tokens", "5"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stderr:  # after transformers' progress bars
            if line.startswith("caddtree: serving"):
                break
        match = re.fullmatch(r"caddtree: serving (\S+) at (http://127\.0\.0\.1:\d+/v1)\n", line)
        assert match, line
        assert match[1] == MODEL
        c = openai.OpenAI(base_url=match[2], api_key="none", max_retries=0, timeout=30)
        resp = c.chat.completions.create(
            model=MODEL, messages=CHAT["messages"], temperature=0, extra_body={"ignore_eos": True}
        )
        assert resp.usage.completion_tokens == 5
        assert resp.model_extra["caddtree"]["method"] == "caddtree"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_a_server_without_a_cost_model_folder_reads_no_file_a_request_names(
    tiny_pair_dirs, cost_file
):
    target, draft = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(
        target, draft, dtype="float64", device="cpu", cost_model=cost_file
    )
    server = Server(build_app(gen, model_name=MODEL, max_new_tokens=4))
    try:
        body = {"prompt": "hi", "cost_model": cost_file}  # an existing file, by its full path
        status, _, reply = post(server, "/v1/completions", json.dumps(body))
        assert status == 400
        assert reply["error"]["param"] == "cost_model"
        assert "--cost-model-dir" in reply["error"]["message"]
    finally:
        server.stop()
