"""A real `kvedge serve` (uvicorn on a loopback port, in a background thread) talked to with the official
openai client and with raw HTTP: answers equal a plain Session's, concurrency is bounded with clean 429s,
memory stays flat, a disconnect frees its row, bad requests get their status while a stream keeps flowing."""

from __future__ import annotations

import gc
import http.client
import json
import os
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from kvedge.runtime import SamplingParams, Session
from tests.serve.conftest import Proxy, client, openai_finish, serving

openai = pytest.importorskip("openai", reason="the serve tests talk with the official openai client (test extra)")

KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def connection(url: str) -> http.client.HTTPConnection:
    host, port = url.split("//")[1].split("/")[0].split(":")
    return http.client.HTTPConnection(host, int(port), timeout=30)


@pytest.fixture(scope="module")
def reference(open_session):
    """A plain Session (its own backend, batch 1, one-shot prefill): the independent reference."""
    return open_session("native", 1)


@pytest.fixture(scope="module")
def fast(open_session):
    """4 rows, at most 8 waiting, prefill chunks of 16, an API key, a 16 KiB body limit."""
    with serving(open_session("native", 4), api_key=KEY, max_queue=8, prefill_chunk=16,
                 max_body_bytes=16 << 10) as s:
        yield s


@pytest.fixture(scope="module")
def slow(open_session):
    """2 rows of a slowed backend, at most 1 waiting."""
    session = open_session("native", 2)
    with serving(Session(Proxy(session.backend, delay=0.01, log=False), session.tokenizer), api_key=KEY, max_queue=1,
                 max_body_bytes=16 << 10) as s:
        yield s


def metric(url: str, line: str) -> float:
    text = urllib.request.urlopen(urllib.request.Request(url.removesuffix("/v1") + "/metrics", headers={
        "Authorization": f"Bearer {KEY}"})).read().decode()
    found = [ln.split()[-1] for ln in text.splitlines() if ln.startswith(line + " ")]
    return float(found[0]) if found else 0.0


def test_completions_and_chat_streamed_or_not_equal_a_plain_session(fast, reference):
    c = client(fast.url, KEY)
    assert [m.id for m in c.models.list().data] == ["demo"]
    ids = [0, 72, 101, 108, 108, 111]
    ref = reference.generate([ids], max_new_tokens=10)
    r = c.completions.create(model="demo", prompt=ids, max_tokens=10, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.texts[0], openai_finish(ref.finish_reasons[0]))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 10, 16)
    chunks = list(c.completions.create(model="demo", prompt=ids, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.texts[0]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == openai_finish(ref.finish_reasons[0])
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices

    # a stop string (from the answer itself) ends it, and is neither in the text nor in the stream: the answer
    # is the unstopped one cut before the stop's first occurrence
    full = ref.texts[0]
    stop = full[3:5]
    assert stop
    r = c.completions.create(model="demo", prompt=ids, max_tokens=10, temperature=0, stop=stop)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="demo", prompt=ids, max_tokens=10, temperature=0, stop=[stop], stream=True))
    assert r.choices[0].text == streamed == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"

    question = "What is 2 + 2?"
    ref = reference.generate(question, chat=True, max_new_tokens=12)
    messages = [{"role": "user", "content": question}]
    r = c.chat.completions.create(model="demo", messages=messages, max_completion_tokens=12, temperature=0)
    assert (r.choices[0].message.role, r.choices[0].message.content) == ("assistant", ref.texts[0])
    assert r.choices[0].finish_reason == openai_finish(ref.finish_reasons[0])
    assert r.usage.completion_tokens == len(ref.tokens[0])
    stream = list(c.chat.completions.create(model="demo", messages=messages, max_tokens=12, temperature=0,
                                            stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == ref.texts[0]

    # seeded sampling with top_k (an extension, in the body) draws what a Session with the same seed draws
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=5)
    ref = reference.generate("Once upon", max_new_tokens=12, sampling=sampling)
    r = c.completions.create(model="demo", prompt="Once upon", max_tokens=12, temperature=0.9, top_p=0.95, seed=5,
                             extra_body={"top_k": 40})
    assert r.choices[0].text == ref.texts[0]
    assert metric(fast.url, "kvedge_time_to_first_token_seconds_count") >= 7
    assert metric(fast.url, "kvedge_inter_token_latency_seconds_count") > 0


def test_32_concurrent_streams_complete_or_get_429_and_equal_each_alone(fast, reference):
    g = torch.Generator().manual_seed(1)
    prompts = [[0] + torch.randint(3, 259, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 40, (32,), generator=g)]
    max_tokens = [8 + i % 9 for i in range(32)]
    results: list = [None] * 32
    rejected_before = metric(fast.url, 'kvedge_requests_total{outcome="rejected"}')
    clients = [client(fast.url, KEY) for _ in range(32)]
    start = threading.Barrier(32)

    def one(i):
        start.wait()
        try:
            stream = clients[i].completions.create(model="demo", prompt=prompts[i], max_tokens=max_tokens[i],
                                                   temperature=0, stream=True)
            results[i] = "".join(ch.choices[0].text for ch in stream)
        except openai.RateLimitError as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    done = [i for i, r in enumerate(results) if isinstance(r, str)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    # 4 rows + 8 waiting are always taken; the rest, arriving while those are busy, are refused at once
    assert len(done) + len(refused) == 32 and len(done) >= 12
    assert all(e.status_code == 429 and e.body["code"] == "rate_limit_exceeded" for e in refused)
    assert metric(fast.url, 'kvedge_requests_total{outcome="rejected"}') - rejected_before == len(refused)
    for i in done:  # each equals the same request alone on a plain Session
        assert results[i] == reference.generate([prompts[i]], max_new_tokens=max_tokens[i]).texts[0], i
    c = client(fast.url, KEY)
    for i in done[:3]:  # and alone on this server
        assert c.completions.create(model="demo", prompt=prompts[i], max_tokens=max_tokens[i],
                                    temperature=0).choices[0].text == results[i]


def test_memory_stays_flat_over_500_requests(fast):
    """Over 500 requests (4 clients at once, streamed and not), after 100 to warm up, the Python heap that
    tracemalloc sees (all live Python allocations made since) stays within 100 kB of its level at request 200
    at each later hundred: it moves with what is in flight, by tens of kB, without a trend. A request that left
    anything behind (its Job holds its prompt, tokens, a generator, an event queue: kilobytes) would add 300 kB
    or more by the end. And the backend's caches and logits are still the buffers allocated at load."""
    backend = fast.scheduler.backend
    buffers = [t.data_ptr() for t in backend.cache_tensors()] + [backend.logits.data_ptr()]
    clients = [connection(fast.url) for _ in range(4)]  # plain keep-alive HTTP: a light client in this process
    ended = metric(fast.url, 'kvedge_requests_total{outcome="length"}')

    def requests(first, n):
        failures = []

        def worker(w):
            try:
                for i in range(first + w, first + n, len(clients)):
                    body = {"prompt": [0, 3 + i % 200, 7, 9 + i % 50], "max_tokens": 2, "temperature": 0,
                            "stream": bool(i % 2), "ignore_eos": True}
                    clients[w].request("POST", "/v1/completions", json.dumps(body), HEADERS)
                    r = clients[w].getresponse()
                    answer = r.read()
                    assert r.status == 200 and (answer.endswith(b"data: [DONE]\n\n") if i % 2 else
                                                json.loads(answer)["usage"]["completion_tokens"] == 2), answer
            except Exception as e:  # noqa: BLE001 - re-raised below: a thread's failure would only be a warning
                failures.append(e)
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures

    requests(0, 100)
    tracemalloc.start()
    try:
        levels = []
        for first in range(100, 500, 100):
            requests(first, 100)
            gc.collect()
            levels.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert max(levels[1:]) - levels[0] < 100_000, f"the Python heap grew: {levels} bytes at requests 200..500"
    assert metric(fast.url, 'kvedge_requests_total{outcome="length"}') - ended == 500
    assert [t.data_ptr() for t in backend.cache_tensors()] + [backend.logits.data_ptr()] == buffers
    assert not fast.scheduler.waiting and fast.scheduler.running == 0


def test_a_full_queue_answers_429_and_a_client_that_leaves_the_queue_frees_its_place(slow):
    """Both rows busy and the one queue place taken: the next request gets a 429 at once; the waiting client goes
    away, and its place is free for the next request at once (not when a row frees)."""
    c = client(slow.url, KEY)
    rejected = metric(slow.url, 'kvedge_requests_total{outcome="rejected"}')
    running = [c.completions.create(model="demo", prompt=[0, 5, 6 + k], max_tokens=200, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True}) for k in range(2)]
    for s in running:
        next(iter(s))
    queued = c.completions.create(model="demo", prompt=[0, 8], max_tokens=3, temperature=0, stream=True)
    wait(lambda: len(slow.scheduler.waiting) == 1, "the third request did not wait")
    with pytest.raises(openai.RateLimitError) as refused:
        c.completions.create(model="demo", prompt=[0, 7], max_tokens=3, temperature=0)
    assert refused.value.status_code == 429 and refused.value.body["code"] == "rate_limit_exceeded"
    assert metric(slow.url, 'kvedge_requests_total{outcome="rejected"}') == rejected + 1
    queued.close()
    wait(lambda: not slow.scheduler.waiting, "the client that left still holds its place in the queue", 2)
    assert slow.scheduler.running == 2  # while both rows are still busy
    again = c.completions.create(model="demo", prompt=[0, 7], max_tokens=3, temperature=0, stream=True)
    for s in running:
        s.close()
    assert list(again)[-1].choices[0].finish_reason in ("length", "stop")


def test_a_client_that_disconnects_frees_its_row(slow):
    c = client(slow.url, KEY)
    cancelled = metric(slow.url, 'kvedge_requests_total{outcome="cancelled"}')
    tokens = metric(slow.url, "kvedge_completion_tokens_total")
    streams = [c.completions.create(model="demo", prompt=[0, 5, 6 + k], max_tokens=200, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True}) for k in range(2)]  # both rows
    for s in streams:
        next(iter(s))
    streams[0].close()  # the client goes away mid-stream
    wait(lambda: metric(slow.url, 'kvedge_requests_total{outcome="cancelled"}') == cancelled + 1,
         "the disconnect was not noticed")
    # the freed row takes the next request while the other stream still runs
    r = c.completions.create(model="demo", prompt=[0, 9, 9], max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and slow.scheduler.running == 1
    rest = list(streams[1])
    assert rest[-1].choices[0].finish_reason in ("length", "stop")
    assert metric(slow.url, "kvedge_completion_tokens_total") - tokens < 200 + 3 + 20  # the first stopped early
    # a non-streaming request whose client goes away is cancelled too
    conn = connection(slow.url)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": [0, 5, 6], "max_tokens": 200, "ignore_eos": True}), HEADERS)
    wait(lambda: slow.scheduler.running == 1, "the request was not admitted")
    conn.close()
    wait(lambda: metric(slow.url, 'kvedge_requests_total{outcome="cancelled"}') == cancelled + 2,
         "the dropped request was not cancelled")
    assert slow.scheduler.running == 0


def wait(condition, what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def post(url: str, body, key: str | None = KEY, path: str = "/completions", headers=None):
    data = body if isinstance(body, bytes) or not isinstance(body, (dict, list)) else json.dumps(body).encode()
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **auth,
                                                                 **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


BAD = [  # (path, body, status, what the message says)
    ("/completions", b'{"prompt": [0, 5], "max_tokens": 3', 400, "malformed JSON"),
    ("/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/completions", b'{"prompt": [0, 5], "temperature": NaN}', 400, "NaN is not JSON"),
    ("/completions", {"prompt": [0, 5], "seed": 2 ** 70}, 400, "is outside [-2**63, 2**64)"),
    ("/completions", {"prompt": [0, 5], "max_tokens": "ten"}, 400, "'max_tokens' must be int, got str"),
    ("/completions", {"prompt": [0, 5], "temperature": "hot"}, 400, "'temperature' must be"),
    ("/completions", {"prompt": [0, 5], "stream": "yes"}, 400, "'stream' must be bool"),
    ("/completions", {"prompt": 3.5}, 400, "'prompt' must be a string or a list of token ids"),
    ("/completions", {"prompt": [0, 5], "stop": [1]}, 400, "'stop' must be at most 4 non-empty strings"),
    ("/chat/completions", {"messages": "hi"}, 400, "'messages' must be a non-empty list"),
    ("/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content must be a string"),
    ("/completions", {"prompt": [0, 999]}, 400, "token id 999 at position 1 of the prompt is outside the vocabulary [0, 259)"),
    ("/completions", {"prompt": [0] * 300}, 400, "300 tokens + max_tokens 16 exceed the context length 256"),
    ("/completions", {"prompt": [0, 5], "max_tokens": 300}, 400, "exceed the context length 256"),
    ("/completions", {"prompt": [0, 5], "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ("/completions", {"prompt": [0, 5], "temperature": -1}, 400, "temperature must be >= 0"),
    ("/completions", {"prompt": [0, 5], "n": 2}, 400, "'n' = 2 is not supported"),
    ("/completions", {"prompt": [0, 5], "logprobs": 2}, 400, "does not return log probabilities"),
    ("/completions", {"prompt": [0, 5], "frequency_penalty": 0.5}, 400, "it has repetition_penalty"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "no tool calling"),
    ("/completions", {"prompt": [0, 5], "frobnicate": 1}, 400, "unsupported parameter(s) 'frobnicate'"),
    ("/completions", {"prompt": ["a", "b"]}, 400, "one prompt per request, got 2"),
    ("/completions", {"prompt": [0, 5], "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist"),
]


def oversized(url: str, chunked: bool) -> tuple[int, dict]:
    """A body over the limit: declared by Content-Length (nothing sent: the server answers from the header), or
    sent in chunks without a length (the server stops reading past the limit)."""
    conn = connection(url)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(10 << 20))))
    conn.endheaders()
    if chunked:
        for part in [b'{"prompt": "'] + [b"x" * 1024] * 20:
            conn.send(b"%x\r\n%s\r\n" % (len(part), part))
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_bad_requests_get_their_status_while_a_stream_keeps_flowing(slow, reference):
    c = client(slow.url, KEY)
    ids = [0, 9, 8, 7]
    stream = iter(c.completions.create(model="demo", prompt=ids, max_tokens=240, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}))
    text = next(stream).choices[0].text
    for path, body, status, says in BAD:
        got, answer = post(slow.url, body, path=path)
        assert (got, answer["error"]["message"].count(says) > 0) == (status, True), (path, got, answer)
    assert post(slow.url, {"prompt": [0] * 300})[1]["error"]["code"] == "context_length_exceeded"
    for chunked in (False, True):
        status, answer = oversized(slow.url, chunked)
        assert status == 413 and "over the limit of 16384 bytes" in answer["error"]["message"]
    for key in (None, "wrong"):
        assert post(slow.url, {"prompt": [0, 5]}, key=key)[0] == 401
        assert post(slow.url, None, key=key, path="/models")[0] == 401
    health = urllib.request.urlopen(slow.url.removesuffix("/v1") + "/health")
    assert health.status == 200 and json.loads(health.read()) == {"status": "ok"}
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        c.completions.create(model="demo", prompt=[0, 999], max_tokens=2)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        client(slow.url, "wrong").completions.create(model="demo", prompt=[0, 5], max_tokens=2)
    assert slow.scheduler.running == 1  # the stream was in flight all along
    text += "".join(ch.choices[0].text for ch in stream)
    assert text == reference.generate([ids], max_new_tokens=240, eos_token_id=None).texts[0]


def test_the_cli_serves_on_loopback_by_default(monkeypatch, demo_export):
    import kvedge.serve
    from kvedge.cli import main

    got = {}
    monkeypatch.setattr(kvedge.serve, "run", lambda app, host, port, log_level: got.update(
        app=app, host=host, port=port))
    monkeypatch.delenv("KVEDGE_API_KEY", raising=False)
    assert main(["serve", str(demo_export(256, 2)[1]), "--max-batch", "3", "--quiet"]) == 0
    assert (got["host"], got["port"]) == ("127.0.0.1", 8000)
    sched = got["app"].state.scheduler
    assert (sched.backend.name, sched.backend.max_batch, sched.max_queue) == ("onnxruntime", 3, 16)


def test_run_moves_what_is_loaded_out_of_the_collectors_reach(monkeypatch):
    """kvedge.serve.run freezes the objects alive at start (gc.freeze) before uvicorn serves, so that a full
    collection under load does not walk the model and its libraries (a pause every stream would wait through)."""
    import gc

    import uvicorn

    import kvedge.serve

    seen = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.append(gc.get_freeze_count()))
    try:
        kvedge.serve.run(object())
        assert seen and seen[0] > 10_000
    finally:
        gc.unfreeze()


def test_without_the_serve_extra_the_error_names_it(monkeypatch, open_session):
    import sys

    from kvedge.errors import MissingDependencyError
    from kvedge.serve import build_app

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'kvedge\[serve\]'"):
        build_app(open_session("native", 1, max_seq_len=32), "demo")


GGUF = os.environ.get("KVEDGE_SMOLLM2_GGUF", "")


@pytest.mark.slow
@pytest.mark.skipif(not Path(GGUF).is_file(), reason="KVEDGE_SMOLLM2_GGUF names no file: `make test` fetches the "
                                                     "real model (make model) and sets it")
def test_the_real_model_answers_the_chat_question():
    """SmolLM2-135M-Instruct (GGUF Q4_1) on the native engine, int16 activations (the float model's answer)."""
    from kvedge.runtime import load

    session = load(GGUF, "native", max_batch=2, max_seq_len=256, activations="int16", threads=2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with serving(session) as s:
        c = client(s.url)
        r = c.chat.completions.create(model="demo", messages=messages, max_tokens=12, temperature=0)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="demo", messages=messages, max_tokens=12, temperature=0, stream=True))
    assert "Paris" in r.choices[0].message.content and streamed == r.choices[0].message.content
