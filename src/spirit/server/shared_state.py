"""What the replicas of one scaled-out deployment share, without Ray: the check that they all
serve the same model, and the adaptive policy's learned state, merged by explicit rules.

`ray_serve.py` carries both through named Ray actors; everything here is plain Python, so
the rules are tested without a cluster (tests/server/test_shared_state.py).

- `Fingerprint`: the model name, a digest of the weights' content, the weights format and
  the dtype. Two replicas serve the same model exactly when their fingerprints are equal
  (the output is a function of all four), whichever node or folder the files sit in.
- `AdaptationKey`: a fingerprint plus this machine's kernel key (`model.probe.machine_key`:
  CPU model and flags, torch, threads, kernel-steering variables). What the spirit policy
  learned is shared only between replicas with the same key: its round costs are the
  machine's, so a replica on other hardware keeps (and shares with its own kind) its own.
- `merge_spirit_state`: how two learned states of the spirit policy (what `--profile-file`
  keeps) become one. The rules, per part of the state:
  * tasks (a centroid of prompt features and its profile): matched by cosine similarity at
    the policy's own threshold; a matched pair keeps the profile with more requests behind
    it (a tie keeps the base's); a task only one side knows is kept, up to the index's bound.
    The base's tasks keep their positions, so a live policy's current task stays valid;
  * plain-decoding speed samples: the union, the newest `MAX_SAMPLES` kept;
  * round costs and the acceptance shared across tasks: per arm, the one measured over more
    windows; a different machine's costs are never taken;
  * the sublayer order: the one of the side with more requests in all.
  Merging is idempotent (a state merged with itself is unchanged), so a replica may publish
  what it pulled without inflating anything; it is not additive: when two replicas refine the
  same task at once, the one with more requests wins and the other's few windows are dropped.
- `PolicySync`: keeps one live policy in step with a store. The policy is read and written
  only on the thread that decodes, at a request's start (apply what was pulled) and end (take
  a snapshot); the store is called only from the sync's own thread, every `interval_s`.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from spirit.policies.features import MIN_SIMILARITY, ProfileIndex, cosine
from spirit.policies.speed_model import MAX_SAMPLES

log = logging.getLogger("spirit.server")

# the methods whose learned state replicas share: merge rules exist for these alone; every
# other method's policy learns per replica, as in one server
SHARED_METHODS = ("spirit",)
MAX_TASKS = ProfileIndex().max_profiles  # the index's own bound on tasks


# -- the same model on every replica ---------------------------------------------------------


@dataclass(frozen=True)
class Fingerprint:
    """What makes two replicas' outputs the same: model, weights content, format, dtype."""

    model: str
    weights_digest: str  # "sha256:..." of the weight files, or "tensors:..." of the loaded tensors
    weights: str  # the precision of the linear layers that decode: bf16, float32, int8, int4
    dtype: str

    def differences(self, other: "Fingerprint") -> list[str]:
        """'field: ours != theirs' for each field that differs."""
        ours, theirs = asdict(self), asdict(other)
        return [f"{k}: {ours[k]} != {theirs[k]}" for k in ours if ours[k] != theirs[k]]

    def describe(self) -> str:
        return f"{self.model} ({self.weights}, {self.dtype}, weights {self.weights_digest[:23]})"


class FingerprintMismatch(RuntimeError):
    """A replica would serve another model than its deployment's first replica does."""


def fingerprint(lm) -> Fingerprint:
    """This loaded `Spirit`'s fingerprint (hashing weight files once per replica start: about
    1 s per GB here; a bundled model's checksum is the one verified when it was fetched)."""
    return Fingerprint(lm.name, content_digest(lm), str(lm.weights), str(lm.dtype).removeprefix("torch."))


def content_digest(lm) -> str:
    """A digest of what the weights are, not where they are: the bundled model's verified
    sha256, else the GGUF file or weight files a folder was loaded from, else (a model built
    in memory, as the tests' tiny ones) the loaded tensors themselves."""
    from spirit.model.bundled import BUNDLED, sha256_of
    from spirit.model.loader import converted_dir, gguf_source

    folder = Path(lm.folder)
    spec = BUNDLED.get(lm.name)
    if spec is not None and folder.resolve() == converted_dir(spec.name).resolve():
        return f"sha256:{spec.sha256}"
    if folder == Path("."):  # from_pretrained_model: no folder
        return _tensor_digest(lm.hf_model)
    source = gguf_source(lm.name, folder)
    files = [source] if source is not None else sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    if not files:
        return _tensor_digest(lm.hf_model)
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}:{sha256_of(path)}\n".encode())
    return f"sha256:{digest.hexdigest()}"


def _tensor_digest(model) -> str:
    import torch

    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return f"tensors:{digest.hexdigest()}"


@dataclass(frozen=True)
class AdaptationKey:
    """Which replicas share learned state: same fingerprint, same machine kernels."""

    fingerprint: Fingerprint
    machine: str  # model.probe.machine_key()

    @property
    def digest(self) -> str:
        text = "|".join([*asdict(self.fingerprint).values(), self.machine])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def actor_name(self) -> str:
        return f"spirit-adaptation-{self.digest}"


def adaptation_key(fp: Fingerprint) -> AdaptationKey:
    from spirit.model.probe import machine_key

    return AdaptationKey(fp, machine_key())


# -- merge rules -------------------------------------------------------------------------------


@dataclass
class _Task:
    centroid: list[float]
    count: int
    profile: dict


def _tasks(state: dict) -> list[_Task]:
    index = state.get("index", {})
    return [_Task(list(c), int(n), p) for c, n, p in
            zip(index.get("centroids", []), index.get("counts", []), state.get("profiles", []))]


def _requests(task: _Task) -> int:
    return int(task.profile.get("requests", 0))


def _merge_tasks(base: list[_Task], incoming: list[_Task]) -> list[_Task]:
    merged = list(base)
    for task in incoming:
        best = _match(task, merged)
        if best is not None:
            if _requests(task) > _requests(merged[best]):
                merged[best] = task
        elif len(merged) < MAX_TASKS:
            merged.append(task)
    return merged


def _match(task: _Task, tasks: list[_Task]) -> int | None:
    """The task of `tasks` that `task` is (the same centroid, as a state pulled and published
    back has: the cheap common case), else the most similar at the policy's threshold."""
    same = next((i for i, other in enumerate(tasks) if other.centroid == task.centroid), None)
    if same is not None:
        return same
    sims = [cosine(task.centroid, other.centroid) for other in tasks]
    best = max(range(len(sims)), key=sims.__getitem__, default=None)
    return best if best is not None and sims[best] >= MIN_SIMILARITY else None


def _merge_samples(base: list, incoming: list) -> list[tuple[float, float]]:
    seen = [tuple(s) for s in base]
    known = set(seen)
    return (seen + [tuple(s) for s in incoming if tuple(s) not in known])[-MAX_SAMPLES:]


def _more_windows(base: dict, incoming: dict) -> dict:
    """Per arm, the figure measured over more windows (a tie keeps the base's)."""
    merged = dict(base)
    for arm, figure in incoming.items():
        if arm not in merged or figure.get("windows", 0) > merged[arm].get("windows", 0):
            merged[arm] = figure
    return merged


def _merge_costs(base: dict, incoming: dict) -> dict:
    same_machine = not base.get("machine") or base.get("machine") == incoming.get("machine")
    merged = {"machine": base.get("machine") or incoming.get("machine", ""),
              "shared": _more_windows(base.get("shared", {}), incoming.get("shared", {}))}
    merged["costs"] = _more_windows(base.get("costs", {}), incoming.get("costs", {}) if same_machine else {})
    return merged


def merge_spirit_state(base: dict | None, incoming: dict | None) -> dict:
    """The spirit policy's `state_dict` that both states lead to (rules in the module doc).
    Neither argument is changed, but the result shares parts with them: a replica applies
    it at a request's start, where copying first would double the cost (16 tasks: 2.0 ms to
    merge and load here, 3.8 ms with a copy)."""
    base, incoming = base or {}, incoming or {}
    if not incoming:
        return base
    if not base:
        return incoming
    tasks = _merge_tasks(_tasks(base), _tasks(incoming))
    base_requests = sum(_requests(t) for t in _tasks(base))
    incoming_requests = sum(_requests(t) for t in _tasks(incoming))
    return {
        "speed": {"samples": _merge_samples(base.get("speed", {}).get("samples", []),
                                            incoming.get("speed", {}).get("samples", []))},
        "index": {"centroids": [t.centroid for t in tasks], "counts": [t.count for t in tasks]},
        "profiles": [t.profile for t in tasks],
        "order": incoming.get("order") if incoming_requests > base_requests else base.get("order", incoming.get("order")),
        "costs": _merge_costs(base.get("costs", {}), incoming.get("costs", {})),
    }


MERGERS: dict[str, Callable[[dict | None, dict | None], dict]] = {"spirit": merge_spirit_state}


def summary(state: dict | None) -> dict:
    """What an operator may see of a learned state: how many tasks, and requests in all.
    Never a prompt feature, a profile or a figure of one request."""
    tasks = _tasks(state or {})
    return {"tasks": len(tasks), "task_requests": sum(_requests(t) for t in tasks)}


# -- keeping a live policy in step with a store ------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """A store's answer: its identity, its version, and a state when there is news."""

    epoch: str  # changes when the store is re-created (its state started empty again)
    version: int
    state: dict | None


class Store(Protocol):
    def publish(self, method: str, state: dict) -> Reply: ...

    def pull(self, method: str, epoch: str, version: int) -> Reply: ...


@dataclass
class SyncStatus:
    connected: bool = False
    epoch: str = ""
    version: int = 0  # the store's version this replica has received
    publishes: int = 0
    pulls: int = 0
    merges: int = 0  # store states applied to the live policy
    errors: int = 0


@dataclass
class PolicySync:
    """Keeps one live policy in step with a shared store (see the module doc for the threads).

    `connect` returns a store (and, for Ray, re-creates the store's actor when it is gone);
    `merge` is the method's merge rule. When the store cannot be reached, the replica keeps
    serving on its local state, retries every `interval_s`, and on a store that came back
    empty (a new epoch) publishes its whole state again."""

    method: str
    connect: Callable[[], Store]
    interval_s: float = 2.0
    merge: Callable[[dict | None, dict | None], dict] = merge_spirit_state
    status: SyncStatus = field(default_factory=SyncStatus)
    _store: Store | None = field(default=None, init=False)
    _outbox: dict | None = field(default=None, init=False)  # a snapshot waiting to be published
    _latest: dict | None = field(default=None, init=False)  # the newest snapshot, for a store that lost its state
    _inbox: dict | None = field(default=None, init=False)  # a store state to apply on the decoding thread
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    # -- the decoding thread's side ----------------------------------------------------------

    def attach(self, policy) -> None:
        """Hook the policy's request boundaries: apply pulled state before a request starts,
        snapshot after one ends, by wrapping those two methods on this one instance (the
        engine calls them on the decoding thread; the policy's class and the engine are
        untouched)."""
        start, end = policy.start_request, policy.end_request

        def start_request(request):
            self.apply(policy)
            return start(request)

        def end_request(stats):
            end(stats)
            self.snapshot(policy)

        policy.start_request, policy.end_request = start_request, end_request

    def apply(self, policy) -> None:
        with self._lock:
            pulled, self._inbox = self._inbox, None
        if pulled is None:
            return
        own = policy.state_dict()
        try:
            policy.load_state_dict(self.merge(own, pulled))
        except Exception:  # a request must never fail for what another replica published
            log.exception("spirit: the shared %s state could not be applied; keeping this replica's own", self.method)
            policy.load_state_dict(own)
            return
        self.status.merges += 1

    def snapshot(self, policy) -> None:
        state = copy.deepcopy(policy.state_dict())
        with self._lock:
            self._outbox = self._latest = state

    def local_summary(self) -> dict:
        """The latest snapshot's aggregates (taken on the decoding thread, so safe to read)."""
        with self._lock:
            latest = self._latest
        return summary(latest)

    # -- the sync thread's side --------------------------------------------------------------

    def first_pull(self, policy) -> None:
        """Before serving (no request runs yet): start from what the store holds."""
        self.sync_once()
        self.apply(policy)
        self.snapshot(policy)
        with self._lock:
            self._outbox = None  # nothing new to publish yet

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spirit-adaptation-sync", daemon=True)
        self._thread.start()

    def stop(self, publish: bool = True) -> None:
        """Stop syncing; publish the last snapshot first (a graceful shutdown loses nothing)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 5)
        if publish:
            self.sync_once()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sync_once()

    def sync_once(self) -> None:
        """Publish the waiting snapshot (the store answers with the merged state), or pull
        news; never raises: an unreachable store leaves the replica on its own state."""
        with self._lock:
            outbox, self._outbox = self._outbox, None
        try:
            store = self._store or self.connect()
            self._store = store
            if outbox is not None:
                reply = store.publish(self.method, outbox)
                self.status.publishes += 1
            else:
                reply = store.pull(self.method, self.status.epoch, self.status.version)
                self.status.pulls += 1
        except Exception as exc:  # the store's actor is gone or unreachable
            self._lost(exc, outbox)
            return
        self._received(reply)

    def _received(self, reply: Reply) -> None:
        new_epoch = bool(self.status.epoch) and reply.epoch != self.status.epoch
        if not self.status.connected and self.status.errors:
            log.warning("spirit: the shared adaptation store is reachable again (version %d)", reply.version)
        self.status.connected, self.status.epoch, self.status.version = True, reply.epoch, reply.version
        with self._lock:
            if reply.state is not None:
                self._inbox = reply.state
            if new_epoch and self._outbox is None and self._latest is not None:
                self._outbox = self._latest  # the store came back empty: give it what we know

    def _lost(self, exc: Exception, outbox: dict | None) -> None:
        if self.status.connected or not self.status.errors:
            log.warning("spirit: the shared adaptation store is unreachable (%s: %s); serving on this "
                        "replica's own learned state and retrying every %.1f s", type(exc).__name__, exc,
                        self.interval_s)
        self.status.connected, self.status.errors = False, self.status.errors + 1
        self._store = None
        with self._lock:
            if self._outbox is None:
                self._outbox = outbox if outbox is not None else self._latest


# -- the store's side (what the Ray actor runs) ----------------------------------------------------


def _new_epoch() -> str:
    import uuid

    return uuid.uuid4().hex


@dataclass
class StateStore:
    """One adaptation key's shared state, per method, merged with `MERGERS`' rules. Plain
    Python: `ray_serve.py` runs it as a named detached actor. A store made again (the actor
    was lost, or restarted after its node died) starts empty with a new epoch, which tells
    the replicas to publish what they know."""

    epoch: str = field(default_factory=_new_epoch)
    states: dict[str, dict] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)

    def publish(self, method: str, state: dict) -> Reply:
        merge = MERGERS.get(method)
        if merge is None:
            raise ValueError(f"no merge rule for method {method!r}; shared methods: {', '.join(MERGERS)}")
        merged = merge(self.states.get(method), state)
        if merged != self.states.get(method):
            self.states[method] = merged
            self.versions[method] = self.versions.get(method, 0) + 1
        # the merged state goes back only when it holds something the publisher lacks; a
        # copy, as through Ray, so that no caller in this process shares the store's objects
        return Reply(self.epoch, self.versions.get(method, 0), copy.deepcopy(merged) if merged != state else None)

    def pull(self, method: str, epoch: str, version: int) -> Reply:
        current = self.versions.get(method, 0)
        news = epoch != self.epoch or version < current
        return Reply(self.epoch, current, copy.deepcopy(self.states.get(method)) if news else None)

    def summary(self, method: str) -> dict[str, Any]:
        return {"version": self.versions.get(method, 0), **summary(self.states.get(method))}


@dataclass
class FingerprintRegistry:
    """The fingerprint each deployment's first replica registered: every later replica of the
    same deployment (one `spirit serve --ray`, one build of the app) must match it. Plain
    Python: `ray_serve.py` runs it as a named detached actor."""

    entries: dict[str, Fingerprint] = field(default_factory=dict)  # generation -> fingerprint
    keep: int = 16  # deployments remembered; an older one's replicas are long replaced

    def register(self, generation: str, fp: Fingerprint) -> Fingerprint | None:
        """None when `fp` may serve in this deployment, else the fingerprint it must have."""
        expected = self.entries.setdefault(generation, fp)
        while len(self.entries) > self.keep:
            del self.entries[next(iter(self.entries))]
        return None if expected == fp else expected
