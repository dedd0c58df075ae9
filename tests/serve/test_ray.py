"""`kvedge serve --ray` on a local Ray instance (loopback only): 2 replicas of the demo model behind Ray Serve's
proxy, talked to with the official openai client and raw HTTP. Answers equal a plain Session's, the single
server's checks hold through the proxy, 16 concurrent clients each complete or get a clean 429, a client that
goes away frees its row on the replica that served it, and a replica killed mid-stream ends that stream with
an error while the other one serves, then Ray's replacement."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.serve.conftest import client, openai_finish

ray = pytest.importorskip("ray", reason="kvedge serve --ray needs Ray (pip install 'kvedge[ray]'; the test extra "
                                        "installs it where Ray publishes wheels)")
openai = pytest.importorskip("openai", reason="the serve tests talk with the official openai client (test extra)")

# one Ray instance for the module: with `-n 2 --dist loadgroup` its tests run on one worker
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.slow]
KEY = "ray-key"
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
ROWS, QUEUE, SEQ = 2, 2, 1024
IDS = [0, 72, 101, 108, 108, 111]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """2 replicas x (2 rows, 2 waiting, 1 thread) of the demo checkpoint on a new local Ray instance."""
    from ray import serve

    from kvedge.models.demo import write_demo_checkpoint
    from kvedge.serve import cluster

    ckpt = write_demo_checkpoint(tmp_path_factory.mktemp("ray") / "demo")
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    port = free_port()
    try:
        cluster.start(str(ckpt), {"backend": "native", "max_batch": ROWS, "max_seq_len": SEQ, "threads": 1},
                      {"model_name": "demo", "api_key": KEY, "max_body_bytes": 16 << 10}, address="local",
                      port=port, placement=cluster.Placement(cpus=1), scaling=cluster.Scaling(replicas=2),
                      max_queue=QUEUE)
        yield f"http://127.0.0.1:{port}/v1", ckpt
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(served):
    from kvedge.runtime import load

    return load(served[1], "native", max_batch=1, max_seq_len=SEQ, threads=1)


def stream(url: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body | {"stream": True}), HEADERS)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return conn, resp


def replica_metric(url: str, replica: str, line: str, deadline_s: float = 30) -> float:
    """`line`'s value in /metrics as answered by `replica` (requests reach whichever replica Ray picks)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        r = urllib.request.urlopen(urllib.request.Request(url.removesuffix("/v1") + "/metrics", headers=HEADERS))
        if r.headers["x-kvedge-replica"] == replica:
            found = [ln.split()[-1] for ln in r.read().decode().splitlines() if ln.startswith(line + " ")]
            return float(found[0]) if found else 0.0
    raise AssertionError(f"no /metrics answer from replica {replica} in {deadline_s} s")


def test_placement_and_scaling_reach_ray():
    """What a replica asks for and how many there are, as Ray's own deployment config reads them."""
    from kvedge.errors import KvedgeError
    from kvedge.serve.cluster import Placement, Scaling, deployment

    d = deployment(Placement(cpus=2, gpus=0.5, resources={"orin_nx": 1}), Scaling(autoscale=(1, 3)), 4, 2)
    assert d.ray_actor_options == {"num_cpus": 2, "num_gpus": 0.5, "resources": {"orin_nx": 1}}
    assert d.max_ongoing_requests == 4 + 2 + 4  # rows + queue + room for /health and /metrics
    auto = d._deployment_config.autoscaling_config  # parsed by Ray (ray/serve/config.py, AutoscalingConfig)
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 3, 4)
    assert deployment(Placement(), Scaling(replicas=3), 1, 0).num_replicas == 3
    for bad in ({"autoscale": (2, 1)}, {"autoscale": (0, 0)}, {"replicas": 0}):
        with pytest.raises(KvedgeError):
            Scaling(**bad)


def test_two_replicas_answer_as_a_plain_session(served, reference):
    url, _ = served
    c = client(url, KEY)
    assert [m.id for m in c.models.list().data] == ["demo"]
    ref = reference.generate([IDS], max_new_tokens=10)
    seen = set()
    for _ in range(12):  # Ray spreads requests over both replicas; each answers as the plain Session does
        raw = c.completions.with_raw_response.create(model="demo", prompt=IDS, max_tokens=10, temperature=0)
        r = raw.parse()
        assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.texts[0], openai_finish(ref.finish_reasons[0]))
        assert r.usage.completion_tokens == 10
        seen.add(raw.headers["x-kvedge-replica"])
    assert len(seen) == 2, f"12 requests reached {len(seen)} replica(s)"

    chunks = list(c.completions.create(model="demo", prompt=IDS, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.texts[0]
    assert len([ch for ch in chunks if ch.choices]) == 11 and chunks[-1].usage.completion_tokens == 10

    question = "What is 2 + 2?"
    ref = reference.generate(question, chat=True, max_new_tokens=12)
    messages = [{"role": "user", "content": question}]
    r = c.chat.completions.create(model="demo", messages=messages, max_completion_tokens=12, temperature=0)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (ref.texts[0],
                                                                        openai_finish(ref.finish_reasons[0]))
    streamed = c.chat.completions.create(model="demo", messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == ref.texts[0]


@pytest.mark.parametrize("path, body, headers, status, code", [
    ("/v1/completions", {"prompt": "hi"}, {"Content-Type": "application/json"}, 401, "invalid_api_key"),
    ("/v1/completions", {"prompt": "x" * (20 << 10)}, HEADERS, 413, None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, HEADERS, 400, "unsupported_parameter"),
    ("/v1/completions", {"prompt": IDS, "max_tokens": SEQ}, HEADERS, 400, "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "other"}, HEADERS, 404,
     "model_not_found"),
])
def test_the_single_server_checks_hold_through_the_proxy(served, path, body, headers, status, code):
    url, _ = served
    req = urllib.request.Request(url.removesuffix("/v1") + path, json.dumps(body).encode(), headers)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == status
    error = json.loads(e.value.read())["error"]  # OpenAI's error object, from the replica
    assert error["code"] == code and error["message"]
    health = urllib.request.urlopen(url.removesuffix("/v1") + "/health")  # no key needed
    assert json.loads(health.read()) == {"status": "ok"} and health.headers["x-kvedge-replica"]


def test_sixteen_concurrent_clients_complete_or_get_a_clean_429(served, reference):
    url, _ = served
    ref = reference.generate([IDS], max_new_tokens=400, eos_token_id=None)
    outcomes, barrier = [], threading.Barrier(16)

    def one():
        c = client(url, KEY)
        barrier.wait()
        try:
            text = "".join(ch.choices[0].text for ch in c.completions.create(
                model="demo", prompt=IDS, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}))
            outcomes.append(("done", text))
        except openai.RateLimitError as e:
            outcomes.append(("429", e.body))
        except Exception as e:  # noqa: BLE001 - anything else is the failure this test looks for
            outcomes.append(("other", repr(e)))

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a client hung"
    kinds = [k for k, _ in outcomes]
    assert len(outcomes) == 16 and kinds.count("other") == 0, outcomes
    assert all(text == ref.texts[0] for k, text in outcomes if k == "done")
    assert all(body["code"] == "rate_limit_exceeded" for k, body in outcomes if k == "429")
    # the 2 replicas hold 2 x (2 rows + 2 waiting) at once (the streams outlast the burst's arrival); each
    # served at least its rows
    assert 2 * ROWS <= kinds.count("done") <= 2 * (ROWS + QUEUE), kinds
    print(f"16 clients: {kinds.count('done')} completed, {kinds.count('429')} got 429")


def test_a_client_that_goes_away_frees_its_row_on_its_replica(served):
    url, _ = served
    conn, resp = stream(url, {"prompt": IDS, "max_tokens": SEQ - len(IDS), "ignore_eos": True})
    replica = resp.getheader("x-kvedge-replica")
    assert resp.readline().startswith(b"data: ")
    cancelled = replica_metric(url, replica, 'kvedge_requests_total{outcome="cancelled"}')
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    end = time.monotonic() + 30
    while replica_metric(url, replica, 'kvedge_requests_total{outcome="cancelled"}') == cancelled:
        assert time.monotonic() < end, "the replica did not see the client go"
        time.sleep(0.2)
    assert replica_metric(url, replica, "kvedge_running_rows") == 0


def test_a_replica_that_cannot_open_the_model_is_one_line_error(served):
    """The replica's own error (here: an export-only backend on a checkpoint), not Ray's "failed to update the
    deployments" with a traceback."""
    from ray import serve

    from kvedge.errors import KvedgeError
    from kvedge.serve import cluster

    with pytest.raises(KvedgeError, match="the replicas did not start: .*no kvedge.json") as e:
        cluster.start(str(served[1]), {"backend": "onnxruntime", "max_batch": 1}, {"model_name": "demo"},
                      placement=cluster.Placement(cpus=0), name="broken", route_prefix="/broken")
    assert "\n" not in str(e.value)
    assert "broken" not in serve.status().applications  # deleted: its replicas would hold the cores they asked for


def test_a_replica_killed_mid_stream_ends_it_with_an_error_and_others_serve(served, reference):
    from ray import serve

    url, _ = served
    c = client(url, KEY)
    started = time.monotonic()
    with pytest.raises(Exception) as e:  # the stream ends, and not as a clean end (the client's transport raises)
        with c.completions.with_streaming_response.create(model="demo", prompt=IDS, max_tokens=SEQ - len(IDS),
                                                          temperature=0, stream=True,
                                                          extra_body={"ignore_eos": True}) as raw:
            victim = raw.headers["x-kvedge-replica"]
            chunks = iter(raw.parse())
            assert next(chunks).choices[0].finish_reason is None
            # Ray Serve names a replica's actor SERVE_REPLICA::APP#DEPLOYMENT#ID (ray/serve/_private/common.py)
            ray.kill(ray.get_actor(f"SERVE_REPLICA::kvedge#kvedge#{victim}", namespace="serve"), no_restart=True)
            killed = time.monotonic()
            got = [ch.choices[0].finish_reason for ch in chunks]
        raise AssertionError(f"the stream ended cleanly {time.monotonic() - killed:.2f} s after the kill, "
                             f"{len(got)} chunks later, finish {got[-1:]}")
    assert not isinstance(e.value, AssertionError), e.value
    assert time.monotonic() - started < 30, "the stream took too long to end"
    print(f"a killed replica's stream ended with {type(e.value).__name__}: {e.value}")

    ref = reference.generate([IDS], max_new_tokens=8)
    answered = []
    for _ in range(4):  # meanwhile the other replica serves
        raw = c.completions.with_raw_response.create(model="demo", prompt=IDS, max_tokens=8, temperature=0)
        assert raw.parse().choices[0].text == ref.texts[0]
        answered.append(raw.headers["x-kvedge-replica"])
    assert victim not in answered

    end = time.monotonic() + 120  # then Ray's replacement replica does too
    while True:
        raw = c.completions.with_raw_response.create(model="demo", prompt=IDS, max_tokens=8, temperature=0)
        assert raw.parse().choices[0].text == ref.texts[0]
        if raw.headers["x-kvedge-replica"] not in {victim, *answered}:
            break
        assert time.monotonic() < end, "no replacement replica answered"
        time.sleep(0.5)
    status = serve.status().applications["kvedge"].deployments["kvedge"]
    assert status.replica_states.get("RUNNING") == 2
