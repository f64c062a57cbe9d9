"""spirit's OpenAI-compatible server on Ray Serve: replicas of the same app behind Ray's proxy.

    spirit serve --ray --replicas 2 --cpus-per-replica 1 --model smollm2-135m
    spirit serve --ray --min-replicas 1 --max-replicas 4 --ray-address auto   # a running cluster

or from Python, `run(ModelSpec("smollm2-135m"), ServerConfig(), RayOptions(replicas=2))`, or
`serve run spirit.server.ray_serve:app_builder model=smollm2-135m replicas=2` (docs/server.md).

Each replica loads one model and builds the app of `spirit.server.app.create_app` over it:
the same engine, scheduler, limits and routes as `spirit serve`, plus a `X-Spirit-Replica`
header on every response and `GET /replica` (which replica, its fingerprint, its sync).
Ray Serve routes requests; `max_ongoing_requests` is the server's own capacity
(`--max-batch` running + `--max-queue` waiting), so Ray never hands a replica a request its
scheduler would refuse.

Two named detached actors, in the Ray namespace "spirit", hold what replicas share (the
rules are in shared_state.py, Ray-free):
- "spirit-fingerprints" (`FingerprintRegistry`): every replica of one deployment must have the
  fingerprint its first replica registered (model, weights content, format, dtype); one that
  differs refuses to start, and the deployment fails with the reason.
- "spirit-adaptation-<key>" (`StateStore`), one per model and machine kind: the spirit
  policy's learned state. Replicas pull it before serving, publish what they learn every
  `sync_interval_s`, and apply what others learned at their next request's start.

Ray is imported inside the functions that use it, never at import time: `spirit serve`
without `--ray` registers these options but never imports Ray.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

from spirit.server.config import ServerConfig
from spirit.server.shared_state import (
    SHARED_METHODS,
    AdaptationKey,
    Fingerprint,
    FingerprintMismatch,
    FingerprintRegistry,
    PolicySync,
    Reply,
    StateStore,
    adaptation_key,
    fingerprint,
)

log = logging.getLogger("spirit.server")

NAMESPACE = "spirit"  # the Ray namespace of spirit's named actors
REGISTRY_ACTOR = "spirit-fingerprints"
DEPLOYMENT = "SpiritServer"
REPLICA_HEADER = "x-spirit-replica"
# every replica, on any node, runs as `spirit` does: never fetching from a model hub
REPLICA_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
STORE_TIMEOUT_S = 10.0  # a store call slower than this counts as the store being unreachable


# -- options -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """How every replica loads its model (the options `spirit serve` takes). A value, not a
    model: it travels to each replica, which loads its own copy."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    weights: str = "auto"
    max_context: int | None = None

    def __post_init__(self) -> None:
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"--max-context must be >= 1, got {self.max_context}")

    def __call__(self):
        import spirit

        lm = spirit.load(self.model, dtype=self.dtype, device=self.device, weights=self.weights)
        if self.max_context is not None:
            lm.engine.max_context = min(self.max_context, lm.engine.max_context)
        return lm


@dataclass(frozen=True)
class RayOptions:
    """How the server scales out; checked when made, so a bad option fails before Ray starts."""

    replicas: int | None = None  # a fixed count; None: 1, unless autoscaling bounds are given
    min_replicas: int | None = None  # autoscaling bounds: Ray Serve scales by ongoing requests
    max_replicas: int | None = None
    # Ray CPUs each replica reserves (fractions allowed); its torch threads are this, rounded
    # down, at least 1: more threads than reserved cores would fight the other replicas
    cpus_per_replica: float = 1.0
    address: str | None = None  # None: start a local Ray cluster; "auto" or host:port: join one
    app_name: str = "spirit"
    route_prefix: str = "/"  # where the proxy serves this app (another app on the cluster needs another)
    sync_interval_s: float = 2.0  # how often a replica publishes what it learned and pulls news
    # times Ray Serve retries a replica that fails to start (None: Ray's default); a refused
    # fingerprint fails the same way every time, so a deployment test wants 1
    constructor_retries: int | None = None

    def __post_init__(self) -> None:
        autoscaling = self.min_replicas is not None or self.max_replicas is not None
        if self.replicas is not None and autoscaling:
            raise ValueError("give --replicas, or --min-replicas/--max-replicas for autoscaling, not both")
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.min_replicas is not None and self.min_replicas < 1:
            raise ValueError(f"--min-replicas must be >= 1 (a replica loads its model before it answers), "
                             f"got {self.min_replicas}")
        if autoscaling and self.bounds[1] < self.bounds[0]:
            raise ValueError(f"--max-replicas ({self.max_replicas}) must be >= --min-replicas ({self.bounds[0]})")
        if not self.cpus_per_replica > 0:
            raise ValueError(f"--cpus-per-replica must be > 0, got {self.cpus_per_replica}")
        if not self.sync_interval_s > 0:
            raise ValueError(f"the sync interval must be > 0 s, got {self.sync_interval_s}")
        if self.constructor_retries is not None and self.constructor_retries < 0:
            raise ValueError(f"constructor_retries must be >= 0, got {self.constructor_retries}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def bounds(self) -> tuple[int, int]:
        """Autoscaling's (min, max) replicas: a missing bound is 1, or the other one."""
        low = 1 if self.min_replicas is None else self.min_replicas
        return low, low if self.max_replicas is None else self.max_replicas

    @property
    def threads(self) -> int:
        return max(1, math.floor(self.cpus_per_replica))

    def deployment_options(self, server: ServerConfig) -> dict[str, Any]:
        """Ray Serve's deployment options for a replica of this server."""
        capacity = server.max_batch + server.max_queue  # what one replica's scheduler accepts
        options: dict[str, Any] = {
            "name": DEPLOYMENT,
            "max_ongoing_requests": capacity,
            # beyond every replica's capacity, a few more wait in Ray's router; the rest get
            # Ray Serve's 503 at once, as the single server answers 429 past --max-queue
            "max_queued_requests": max(1, server.max_queue),
            "ray_actor_options": {"num_cpus": self.cpus_per_replica, "runtime_env": {"env_vars": dict(REPLICA_ENV)}},
        }
        if self.constructor_retries is not None:
            options["max_constructor_retry_count"] = self.constructor_retries
        if self.autoscaling:
            low, high = self.bounds
            options["autoscaling_config"] = {
                "min_replicas": low, "max_replicas": high,
                # a replica is busy with max_batch requests running: more means a wait
                "target_ongoing_requests": server.max_batch,
            }
        else:
            options["num_replicas"] = self.replicas or 1
        return options


@dataclass(frozen=True)
class ReplicaOptions:
    """What each replica is given: how to load the model, how to serve, which deployment."""

    load: Callable[[], Any]  # returns a Spirit: a ModelSpec, or any picklable callable (tests)
    server: ServerConfig
    generation: str  # one per deploy: the replicas whose fingerprints must agree
    threads: int
    sync_interval_s: float


# -- the shared actors ----------------------------------------------------------------------------


@cache
def _remote(cls: type):
    import ray

    return ray.remote(cls)


def named_actor(cls: type, name: str):
    """The named detached actor `name` (made now if there is none): it outlives the replicas
    and the driver that made it, and lives as long as the Ray cluster does. It takes no CPU,
    and Ray restarts it (empty) if its node dies."""
    return _remote(cls).options(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                                num_cpus=0, max_restarts=-1).remote()


def registry():
    return named_actor(FingerprintRegistry, REGISTRY_ACTOR)


def adaptation_store(key: AdaptationKey):
    return named_actor(StateStore, key.actor_name())


@dataclass
class RayStore:
    """A `shared_state.Store` over the actor: each call waits at most `timeout_s`."""

    actor: Any
    timeout_s: float = STORE_TIMEOUT_S

    def publish(self, method: str, state: dict) -> Reply:
        import ray

        return ray.get(self.actor.publish.remote(method, state), timeout=self.timeout_s)

    def pull(self, method: str, epoch: str, version: int) -> Reply:
        import ray

        return ray.get(self.actor.pull.remote(method, epoch, version), timeout=self.timeout_s)


def check_fingerprint(generation: str, fp: Fingerprint, replica: str) -> None:
    """Raise FingerprintMismatch unless `fp` is the deployment's (the first to register sets it)."""
    import ray

    expected = ray.get(registry().register.remote(generation, fp), timeout=STORE_TIMEOUT_S)
    if expected is not None:
        raise FingerprintMismatch(
            f"replica {replica} refuses to start: it loaded {fp.describe()}, but this deployment serves "
            f"{expected.describe()} ({'; '.join(fp.differences(expected))}). Every replica must serve the same "
            "model, weights and dtype: give every node the same model files and --weights/--dtype")


# -- the replica -------------------------------------------------------------------------------------


def _replica_ids() -> tuple[str, str]:
    """(short id, Ray actor name) of the replica this runs in."""
    from ray import serve

    replica = serve.get_replica_context().replica_id
    return replica.unique_id, replica.to_full_id_str()


class ReplicaHeader:
    """Pure ASGI middleware: every response names the replica that answered (streams too,
    and refusals that never reach a route)."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.value)]}
            await send(message)

        await self.app(scope, receive, named)


class SpiritReplica:
    """One Ray Serve replica: a model, the server's own app over it, and its adaptation sync.
    Wrapped by `serve.ingress()` in `build`; Ray Serve calls `__serve_build_asgi_app__` after
    the constructor."""

    def __init__(self, options: ReplicaOptions) -> None:
        import torch

        torch.set_num_threads(options.threads)  # before the load: the dtype probe measures with them
        self.options = options
        self.replica, self.actor_name = _replica_ids()
        self.lm = options.load()
        self.fingerprint = fingerprint(self.lm)
        check_fingerprint(options.generation, self.fingerprint, self.replica)
        self.key = adaptation_key(self.fingerprint)
        self.syncs: dict[str, PolicySync] = {}

    def __serve_build_asgi_app__(self):
        from spirit.server.app import create_app

        app = create_app(self.lm, self.options.server)  # readies the allowed methods first
        self._share_adaptation()

        @app.get("/replica")
        async def replica() -> dict:
            return self.describe()

        app.add_middleware(ReplicaHeader, replica=self.replica)
        return app

    def _share_adaptation(self) -> None:
        from spirit.request import default_draft

        for method in SHARED_METHODS:
            if method not in self.options.server.allowed_methods:
                continue
            # the very policy requests of this method use (the key of Spirit.policy)
            policy = self.lm.policy(method, None, default_draft(method))
            sync = PolicySync(method, lambda: RayStore(adaptation_store(self.key)), self.options.sync_interval_s)
            sync.first_pull(policy)
            sync.attach(policy)
            sync.start()
            self.syncs[method] = sync

    def describe(self) -> dict:
        """GET /replica: which replica, what it serves, how its sync stands. Aggregates only:
        no request's text, figures or profile (docs/server.md, "What a response tells a client")."""
        return {
            "replica": self.replica, "actor": self.actor_name, "generation": self.options.generation,
            "fingerprint": asdict(self.fingerprint),
            "adaptation": {"key": self.key.digest, "store": self.key.actor_name(),
                           **{m: {**asdict(s.status), **s.local_summary()} for m, s in self.syncs.items()}},
        }

    def __del__(self) -> None:
        # Ray Serve calls this after the app's shutdown (its scheduler has stopped): publish
        # the last snapshot, so a graceful stop loses nothing learned
        for sync in getattr(self, "syncs", {}).values():
            sync.stop()


# -- deploying ---------------------------------------------------------------------------------------


def build(load: Callable[[], Any], server: ServerConfig, options: RayOptions, generation: str | None = None):
    """The Ray Serve application: `load` is how each replica gets its model (a ModelSpec).
    Every replica of one `generation` (default: a new one per build) must have the same
    fingerprint; name another deployment's (its GET /replica says it) to hold a second app
    to the same model."""
    from ray import serve

    replica = ReplicaOptions(load, server, generation or uuid.uuid4().hex, options.threads,
                             options.sync_interval_s)
    deployment = serve.deployment(**options.deployment_options(server))(serve.ingress()(SpiritReplica))
    return deployment.bind(replica)


def run(load: Callable[[], Any], server: ServerConfig, options: RayOptions, host: str = "127.0.0.1",
        port: int = 8000, generation: str | None = None) -> str:
    """Deploy on Ray (joining `options.address`, or a new local cluster, unless this process
    is connected already) and return the base URL once every replica answers."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=options.address, logging_level=logging.WARNING)
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(build(load, server, options, generation), name=options.app_name, route_prefix=options.route_prefix)
    except RuntimeError as exc:  # Ray's message names the deployment; its status says why
        raise DeploymentFailed(_failure_reason(f"{exc} {_deployment_messages(options.app_name)}")) from None
    return f"http://{host}:{port}{options.route_prefix.rstrip('/')}"


class DeploymentFailed(RuntimeError):
    """The app did not start; the message carries the replicas' own reasons."""


def _deployment_messages(app: str) -> str:
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return ""
    return " ".join(d.message for d in status.deployments.values() if d.message)


def app_builder(args: dict[str, Any]):
    """For `serve run spirit.server.ray_serve:app_builder model=... replicas=2` or a Serve
    config file's `import_path`: the keys are `spirit serve`'s options with underscores
    (model, dtype, weights, max_context, method, max_queue, max_batch, allow_methods, api_key,
    replicas, min_replicas, max_replicas, cpus_per_replica, ...). Unknown keys are refused."""
    groups = {"model": ModelSpec, "server": ServerConfig, "ray": RayOptions}
    taken: dict[str, dict[str, Any]] = {name: {} for name in groups}
    fields = {name: set(cls.__dataclass_fields__) for name, cls in groups.items()}
    fields["ray"] -= {"address", "app_name", "route_prefix"}  # the serve CLI / config file decides these
    for key, value in args.items():
        group = next((name for name, names in fields.items() if key in names), None)
        if group is None:
            known = sorted(set().union(*fields.values()))
            raise ValueError(f"unknown option {key!r} for spirit on Ray Serve; known: {', '.join(known)}")
        taken[group][key] = _typed(groups[group], key, value)
    if "model" not in taken["model"]:
        raise ValueError("model= is required, e.g. model=smollm2-135m")
    return build(ModelSpec(**taken["model"]), ServerConfig(**taken["server"]), RayOptions(**taken["ray"]))


def _typed(cls: type, key: str, value: Any) -> Any:
    """A `serve run key=value` string as the field's type (int, float, or a tuple of names)."""
    if not isinstance(value, str):
        return value
    kind = str(cls.__dataclass_fields__[key].type)
    if value.lower() in ("none", "null", ""):
        return None
    if "tuple" in kind:
        return value
    for name, convert in (("int", int), ("float", float)):
        if kind.startswith(name) or f"{name} |" in kind:
            try:
                return convert(value)
            except ValueError:
                raise ValueError(f"{key}={value!r} is not a{'n' if name == 'int' else ''} {name}") from None
    return value


# -- the command line ---------------------------------------------------------------------------


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """`spirit serve`'s Ray options (registered always; Ray is needed only with --ray)."""
    g = p.add_argument_group("Ray Serve (pip install -e '.[ray]'; see docs/server.md)")
    g.add_argument("--ray", action="store_true",
                   help="serve replicas of this server on Ray Serve, sharing what the spirit policy learns")
    g.add_argument("--replicas", type=int, default=None, help="a fixed number of replicas (default 1)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscale between these bounds by ongoing requests")
    g.add_argument("--max-replicas", type=int, default=None)
    g.add_argument("--cpus-per-replica", type=float, default=None,
                   help="Ray CPUs each replica reserves, fractions allowed (default 1); torch threads = this, rounded down, >= 1")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto': the one `ray start` runs here); default: start a local one")


RAY_ONLY = ("replicas", "min_replicas", "max_replicas", "cpus_per_replica", "ray_address")


def ray_options(args: argparse.Namespace) -> RayOptions | None:
    """The Ray options given, or None without --ray (when giving one is an error)."""
    given = [name for name in RAY_ONLY if getattr(args, name, None) is not None]
    if not getattr(args, "ray", False):
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --ray")
        return None
    cpus = args.cpus_per_replica if args.cpus_per_replica is not None else 1.0
    return RayOptions(replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                      cpus_per_replica=cpus, address=args.ray_address)


def serve_on_ray(args: argparse.Namespace, config: ServerConfig, options: RayOptions) -> int:
    """`spirit serve --ray`: deploy, then wait until Ctrl-C, which deletes the app (the
    shared actors stay on a cluster that outlives this command)."""
    spec = ModelSpec(args.model, args.dtype, args.device, args.weights, args.max_context)
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise ValueError("spirit serve --ray needs Ray Serve, which the 'ray' extra installs: "
                         "pip install -e '.[ray]' (or pip install 'spirit[ray]')")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        print(f"spirit: warning: listening on {args.host} without an API key", flush=True)
    scale = ("{}..{} replicas (autoscaling)".format(*options.bounds) if options.autoscaling
             else f"{options.replicas or 1} replica(s)")
    print(f"spirit: deploying {args.model} on Ray Serve: {scale} at {options.cpus_per_replica:g} CPU each, "
          f"{config.max_batch + config.max_queue} ongoing requests per replica", flush=True)
    import ray
    from ray import serve

    try:
        url = run(spec, config, options, args.host, args.port)
    except DeploymentFailed as exc:  # a replica refused to start, or the deployment failed otherwise
        raise ValueError(f"the Ray Serve deployment failed: {exc}") from None
    print(f"spirit: serving {config.model_name or args.model} on {url}/v1 ({config.method}; requests may name "
          f"{', '.join(config.allowed_methods)}); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("spirit: deleting the Ray Serve app", flush=True)
        serve.delete(options.app_name)
        if options.address is None:
            ray.shutdown()
    return 0


def _failure_reason(text: str) -> str:
    """A replica's own refusal when there is one (the line after its traceback), else Ray's
    message with where the replica logs are."""
    refusal = [line for line in text.splitlines() if f"{FingerprintMismatch.__name__}:" in line]
    if refusal:
        return refusal[-1].split(f"{FingerprintMismatch.__name__}:", 1)[1].strip()
    return f"{text.strip()} (replica logs: /tmp/ray/session_latest/logs/serve on each node)"
