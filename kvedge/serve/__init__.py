"""`kvedge serve`: an OpenAI-compatible HTTP server over any kvedge backend, with continuous batching.

    from kvedge.serve import build_app
    app = build_app(kvedge.load("demo/onnx", max_batch=4), model_name="demo")   # a Starlette app for uvicorn

scheduler.py owns the backend (one thread; admission, chunked prefill, decode), app.py maps the API onto it,
metrics.py renders GET /metrics. Starlette, uvicorn and prometheus_client come with `pip install
'kvedge[serve]'`. docs/serve.md describes the API and the options.
"""

from __future__ import annotations

from kvedge.errors import KvedgeError, require
from kvedge.runtime.session import Session


def build_app(session: Session, model_name: str, *, api_key: str | None = None, max_queue: int = 16,
              prefill_chunk: int | None = None, max_body_bytes: int | None = None):
    """The server's Starlette app over a Session's backend and tokenizer (its lifespan runs the scheduler)."""
    for module in ("starlette", "uvicorn", "prometheus_client"):
        require(module, "serve", "kvedge serve")
    from kvedge.serve.app import MAX_BODY_BYTES, create_app
    from kvedge.serve.metrics import Metrics
    from kvedge.serve.scheduler import PREFILL_CHUNK, Scheduler

    if session.tokenizer is None:
        raise KvedgeError("kvedge serve needs the model's tokenizer (tokenizer.json in the folder, or a GGUF file)")
    scheduler = Scheduler(session.backend, session.tokenizer, max_queue=max_queue, metrics=Metrics(),
                          chunk_size=PREFILL_CHUNK if prefill_chunk is None else prefill_chunk)
    return create_app(scheduler, model_name, api_key, max_body_bytes or MAX_BODY_BYTES)


def freeze_heap() -> None:
    """Move the objects alive now (the model, torch, the libraries: hundreds of thousands) out of the garbage
    collector's reach: a full collection would walk them all while holding the GIL, a pause every stream waits
    through (docs/benchmarks.md); the requests' own objects are collected as before."""
    import gc

    gc.collect()
    gc.freeze()


def run(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` with uvicorn until interrupted, the heap frozen first (freeze_heap)."""
    import uvicorn

    freeze_heap()
    uvicorn.run(app, host=host, port=port, log_level=log_level)
