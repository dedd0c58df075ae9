"""`kvedge serve --ray`: the same server as replicas of one Ray Serve deployment.

Each replica is a Ray actor that opens its own Session and runs exactly the single-process app
(kvedge.serve.build_app: its own scheduler, cache rows, API key, body limit, 429s and OpenAI-style errors);
Ray Serve's HTTP proxy routes requests to replicas, streams their server-sent events back, restarts a replica
that dies or fails its health check, and scales the count on load when asked. Nothing here routes or balances:
that is Ray's. The replicas' answers carry `x-kvedge-replica` (the Ray replica's id) so that a client can tell
which one answered.

Requires `pip install 'kvedge[ray]'`; the single-process server never imports Ray. docs/serve.md has the cluster
steps.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field

from kvedge.errors import KvedgeError, require

log = logging.getLogger("kvedge.serve")
APP_NAME = "kvedge"
REPLICA_HEADER = b"x-kvedge-replica"
DELETE_TIMEOUT_S = 10


@dataclass(frozen=True)
class Placement:
    """What each replica asks Ray for, so that Ray places it on a node that has it: CPU cores (the backend's
    threads), GPUs (a TensorRT engine, or onnxruntime's CUDA provider), custom resources (`ray start
    --resources '{"orin": 1}'` on a board, {"orin": 1} here)."""

    cpus: float = 1.0
    gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)

    def actor_options(self) -> dict:
        return {"num_cpus": self.cpus, "num_gpus": self.gpus, "resources": dict(self.resources)}


@dataclass(frozen=True)
class Scaling:
    """A fixed count (replicas), or autoscaling between min and max replicas on ongoing requests, aiming at
    `target` in flight per replica (default: its cache rows, each replica's batch full)."""

    replicas: int = 1
    autoscale: tuple[int, int] | None = None
    target: float | None = None

    def __post_init__(self):
        if self.autoscale is None and self.replicas < 1:
            raise KvedgeError(f"replicas must be >= 1, got {self.replicas}")
        if self.autoscale is not None and not (0 <= self.autoscale[0] <= self.autoscale[1] and self.autoscale[1] >= 1):
            raise KvedgeError(f"autoscaling needs 0 <= MIN <= MAX and MAX >= 1, got {self.autoscale[0]}:"
                              f"{self.autoscale[1]}")

    def options(self, max_batch: int) -> dict:
        if self.autoscale is None:
            return {"num_replicas": self.replicas}
        lo, hi = self.autoscale
        return {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi, "initial_replicas": max(lo, 1),
                                       "target_ongoing_requests": self.target or max_batch}}


class Replica:
    """One replica: a Session opened in the actor (the model is never shipped through Ray), then the
    single-process app over it. Ray calls check_health every few seconds; a dead scheduler thread fails it,
    and Ray replaces the replica."""

    def __init__(self, path: str, load_options: dict, app_options: dict):
        from kvedge.runtime import load

        self.session = load(path, **load_options)
        self.app_options = app_options
        self.server = None  # the Starlette app (`app` is the Ray wrapper's)

    def __serve_build_asgi_app__(self):
        from ray import serve

        from kvedge.serve import build_app, freeze_heap

        self.server = build_app(self.session, **self.app_options)
        freeze_heap()  # as kvedge.serve.run does
        return tagged(self.server, serve.get_replica_context().replica_id.unique_id)

    def check_health(self) -> None:
        scheduler = self.server.state.scheduler if self.server is not None else None
        if scheduler is not None and not scheduler.alive:
            raise RuntimeError("the kvedge scheduler thread has stopped")


def tagged(app, replica: str):
    """`app` with `x-kvedge-replica: replica` on every HTTP answer; lifespan and the app's state pass through."""
    value = replica.encode()

    async def asgi(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, value)]}
            await send(message)

        await app(scope, receive, send_tagged)

    asgi.state = app.state
    return asgi


def deployment(placement: Placement, scaling: Scaling, max_batch: int, max_queue: int):
    """The Ray Serve deployment of Replica. A replica takes up to max_batch + max_queue requests (then answers
    429 itself, as one server does) plus a few for /health, /metrics and /v1/models; past that Ray's proxy
    holds requests until one has room."""
    serve = require("ray.serve", "ray", "kvedge serve --ray")
    return serve.deployment(serve.ingress()(Replica), name=APP_NAME, ray_actor_options=placement.actor_options(),
                            max_ongoing_requests=max_batch + max_queue + 4, health_check_period_s=5,
                            health_check_timeout_s=30, **scaling.options(max_batch))


def application(path: str, load_options: dict, app_options: dict, *, placement: Placement = Placement(),
                scaling: Scaling = Scaling(), max_queue: int = 16):
    """The Ray Serve application (not yet running): the deployment bound to what each replica opens."""
    return deployment(placement, scaling, load_options.get("max_batch") or 1, max_queue).bind(
        str(path), load_options, app_options | {"max_queue": max_queue})


def start(path: str, load_options: dict, app_options: dict, *, address: str | None = None,
          host: str = "127.0.0.1", port: int = 8000, placement: Placement = Placement(),
          scaling: Scaling = Scaling(), max_queue: int = 16, name: str = APP_NAME, route_prefix: str = "/",
          progress=log.warning):
    """Connect to Ray (address: a cluster's, "local" for a new instance on this machine, None for Ray's
    default: $RAY_ADDRESS, else a cluster started on this machine with `ray start`, else a new local instance),
    start Serve's proxy on host:port, deploy the replicas as the application `name` under `route_prefix` (several
    models or configurations can share one proxy) and wait until they are ready, passing what Ray says about
    replicas still starting to progress(line). Returns the handle."""
    ray = require("ray", "ray", "kvedge serve --ray")
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    app = application(path, load_options, app_options, placement=placement, scaling=scaling, max_queue=max_queue)
    waiting = threading.Event()
    threading.Thread(target=_report, args=(serve, name, waiting, progress), daemon=True).start()
    try:
        return serve.run(app, name=name, route_prefix=route_prefix, blocking=False)
    except RuntimeError as e:  # Ray says "failed to update the deployments"; the replica's own error is in status
        try:
            message = serve.status().applications[name].deployments[APP_NAME].message
        except (KeyError, AttributeError):
            message = str(e)
        last = [line for line in message.strip().splitlines() if line.strip()][-1:] or [str(e)]
        serve.delete(name)  # else Ray keeps retrying the replicas, holding what they asked for
        raise KvedgeError(f"the replicas did not start: {last[0].strip()}") from None
    finally:
        waiting.set()


def _report(serve, name: str, done: threading.Event, progress, every_s: float = 10) -> None:
    """While the replicas start, pass on what Ray says about them when it changes: a replica that no node can
    take (its resources are nowhere free) waits silently otherwise."""
    said = ""
    while not done.wait(every_s):
        try:
            message = serve.status().applications[name].deployments[APP_NAME].message
        except (KeyError, AttributeError):
            continue
        if message and message != said:
            progress(message.strip().splitlines()[0])  # its first line; a constructor's traceback follows
            said = message


def serve_forever(path: str, load_options: dict, app_options: dict, on_ready=lambda: None, **kw) -> None:
    """start(), on_ready(), then serve until Ctrl-C or SIGTERM (during startup as well); the application is
    deleted at the end (a cluster started with `ray start` stays up, a local instance ends with the process)."""
    import ray
    from ray import serve

    done = threading.Event()
    try:
        start(path, load_options, app_options, **kw)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        on_ready()
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if ray.is_initialized():
            # a service manager's SIGTERM often reaches Ray's own processes too (the whole process group or
            # cgroup): with its control store gone, delete would wait forever, so it gets a bound
            gone = threading.Thread(target=serve.delete, args=(APP_NAME,), daemon=True)
            gone.start()
            gone.join(DELETE_TIMEOUT_S)
            if gone.is_alive():
                log.warning("kvedge serve: Ray did not confirm deleting the application in %d s", DELETE_TIMEOUT_S)
