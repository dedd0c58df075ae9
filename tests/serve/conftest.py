"""Shared fixtures of the kvedge serve tests: sessions on the demo checkpoint (random weights, byte-level
tokenizer) per backend, and a real server (uvicorn) on a free loopback port in a background thread."""

from __future__ import annotations

import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

SEQ = 256  # the demo export's cache length, and the checkpoint backends' here
BACKENDS = ["native", "torch", "onnxruntime"]


@pytest.fixture(scope="session")
def open_session(demo_export, tmp_path_factory):
    """open_session(backend, max_batch, max_seq_len=SEQ, kv_dtype=None) -> a Session on the demo model
    (onnxruntime: its export, shared with tests/runtime, whose cache length is SEQ; exported only when asked for)."""
    from kvedge.models.demo import write_demo_checkpoint

    ckpt = write_demo_checkpoint(tmp_path_factory.mktemp("serve") / "demo")

    def get(backend: str, max_batch: int, max_seq_len: int = SEQ, kv_dtype: str | None = None):
        from kvedge.runtime import load

        if backend == "native" and shutil.which("cc") is None and shutil.which("gcc") is None:
            pytest.skip("the native engine needs a C compiler")
        path = demo_export(SEQ, 2)[1] if backend == "onnxruntime" else ckpt
        # one thread: the demo model is small, and a team of threads on a busy 2-core machine waits on its
        # slowest member (torch's count is process-wide: left as it is)
        return load(path, backend, max_batch=max_batch, max_seq_len=max_seq_len, threads=int(backend != "torch"),
                    kv_dtype=kv_dtype)

    return get


class Proxy:
    """A backend as the scheduler sees it, for the tests: each forward's (ids shape, first_row) recorded in
    `calls` (unless log=False: a long-running server would grow it), a failure injected where fail(ids,
    first_row) holds, and at least `delay` seconds a forward, so that a stream is still flowing while a test
    does something else."""

    def __init__(self, backend, fail=None, delay: float = 0.0, log: bool = True):
        self.backend, self.fail, self.delay, self.calls = backend, fail, delay, [] if log else None
        self.cfg, self.max_batch, self.max_seq_len = backend.cfg, backend.max_batch, backend.max_seq_len

    def forward(self, ids, pos, last, first_row=0):
        if self.calls is not None:
            self.calls.append((tuple(ids.shape), first_row))
        if self.delay:
            time.sleep(self.delay)
        if self.fail is not None and self.fail(ids, first_row):
            raise RuntimeError("injected failure")
        return self.backend.forward(ids, pos, last, first_row=first_row)


def openai_finish(reason: str) -> str:
    """A Session's finish reason as the OpenAI API says it: an EOS token is a "stop"."""
    return {"eos": "stop"}.get(reason, reason)


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT/v1
    scheduler: object


@contextmanager
def serving(session, **kw):
    """A real server over `session` on 127.0.0.1, on a port the OS picks, in a background thread."""
    import uvicorn

    from kvedge.serve import build_app

    app = build_app(session, "demo", **kw)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Served(f"http://127.0.0.1:{port}/v1", app.state.scheduler)
    finally:
        server.should_exit = True
        thread.join(30)


def client(url: str, api_key: str = "none", **kw):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=60, **kw)
