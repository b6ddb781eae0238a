"""Language models on a cluster's replicas, as a server sees one of its own. Runs in the
front end's process (``RemoteLanguageModel``); the replicas load each model's ``LLMDef``
(``llm/model.py``).

NOTE [Language models on a cluster]
Every replica loads every language model of the config into its runtime (its weights in
the host store, loaded onto the device on demand, pipelined, as on one machine) with an
engine of its own; a generation runs whole on one replica, streamed back token by token
through a Ray generator (``Replica.generate``). The front end keeps the tokenizer (read
from the same directory), so prompts are checked and encoded before anything is sent,
and errors about them are the same as on one machine. Which replica generates: the one
that generated for this model last (its weights, and perhaps its turn, are there) while
it has fewer generations of the model in flight than the model decodes together, and
fewer in all than its actor runs at once (an adapter's: NOTE [Adapters on a cluster]);
else the live replica with the fewest generations in flight. A generation whose replica dies
ends with an error (it is not retried: tokens may have been sent already), and so does
one whose next token does not come within the call deadline. Cancelling one (a client
that leaves) reaches its replica beside whatever it is running, even before the
generation has started there. Generations run in a concurrency group of the replica's
actor of their own, as many as its language models decode together (the sum of their
``max_sequences``); when every live replica has that many, a new one is refused (503).
A cluster may serve language models alone: there is then no model for the router to
place (``Cluster.requests`` is None), and the replicas only generate.

NOTE [Adapters on a cluster]
A language model's LoRA adapters are served by every replica, each with slots of its own
(NOTE [Adapter residency] there, unchanged), read from directories every replica can
read. The front end keeps the table a server reads (``RemoteAdapters``): each adapter is
read there once, against the slots the replicas make, so that a bad one is a 400 before
any replica reads it, and then only its name crosses with a generation. An adapter
loaded or unloaded at run time is so on every live replica, and is written into the
model's ``LLMDef`` the replica set starts new replicas from, so that a replica added
later (or one replacing a lost one) serves it too; one found dead meanwhile is lost, not
an error. A replica's start and a load take turns, so a replica starts with the adapters
served then or is told of the load. A load that a replica refuses (a directory the front
end reads and it cannot) is raised once every answer is in, and the replicas that took it
are put back as they were (without it, or with the adapter it replaced); the front end
has the last word on names, so a replica's load replaces whatever it holds under one.
With ``lora_dir``, the front end checks a name on its first request and each
replica reads it on its own first request. An adapter's generation goes to the replica
that generated for it last while that one has room (``cluster/generations.py``), before
the model's last one: its slot there likely still holds it, where another replica must
copy it in (a few milliseconds: NOTE [Adapters streamed in]). Which slots hold what is not
asked of the replicas: an adapter loaded again or unloaded has no such replica, nor has
one routed less recently than ``ADAPTER_HOMES`` others (a resolver serves any name).
``timeshare ps`` shows an adapter in the slot it has on some replica, as of the last poll.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from timeshare.dtypes import parse_dtype
from timeshare.errors import ConfigError, Unavailable, UnknownModelError
from timeshare.llm.adapters import (
    DEFAULT_SLOTS,
    Adapter,
    AdapterInfo,
    KnownAdapter,
    adapter_spec,
    check_name,
    resolvable,
)
from timeshare.llm.constrained import LLGuidance
from timeshare.llm.engine import EngineSnapshot
from timeshare.llm.hfdir import shard_files, weights_dtype
from timeshare.llm.model import LLMDef, Texts, open_directory
from timeshare.llm.sampling import SamplingParams
from timeshare.llm.sequence import (
    Completion,
    Delta,
    Event,
    Finish,
    SequenceDone,
    TokenTiming,
    check_prompt,
    collect,
    read_events,
)

if TYPE_CHECKING:
    from timeshare.cluster.backend import ClusterRuntime

log = logging.getLogger(__name__)


class RemoteGeneration:
    """One generation on a replica: its events go to ``on_event`` (or are read with
    ``result``) as they arrive; ``cancel`` stops it there."""

    def __init__(self, cancel: Callable[[], None], on_event: Callable[[Delta | Finish], None] | None):
        self._cancel = cancel
        self._on_event = on_event
        self._events: queue.Queue[Delta | Finish] = queue.Queue()
        self._cancelled = threading.Event()
        self._finished = threading.Event()

    def cancel(self) -> None:
        if not self._cancelled.is_set() and not self._finished.is_set():  # a finished one has nothing to stop
            self._cancelled.set()
            self._cancel()

    def put(self, event: Delta | Finish) -> None:
        if isinstance(event, Finish):
            self._finished.set()
        if self._on_event is not None:
            self._on_event(event)
        else:
            self._events.put(event)

    def result(self, timeout_s: float) -> Completion:
        """The whole completion (when no ``on_event`` was given); raises its error. Its
        tokens stay on the replica: only the text comes back."""
        return collect(read_events(self._events, timeout_s, self.cancel, "generation"), [])


class RemoteEngine:
    """The model's engines on the replicas, as one: their listeners, their snapshots added up."""

    def __init__(self, owner: ClusterRuntime, name: str, max_sequences: int, max_context: int):
        self._owner, self.name = owner, name
        self.max_sequences, self.max_context = max_sequences, max_context
        self.listeners: list[Callable[[Event], None]] = []
        self.closed = False

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        self.listeners.append(listener)

    def emit(self, event: Event) -> None:
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:  # a listener's bug must not end the generation
                log.exception("model %s: a listener failed on %r", self.name, event)

    def snapshot(self) -> EngineSnapshot:
        """The replicas' engines added up (as of the owner's last poll), with this model's limits."""
        views = self._owner.llm_snapshots(self.name)
        return EngineSnapshot(running=sum(v.running for v in views), waiting=sum(v.waiting for v in views),
                              kv_bytes=sum(v.kv_bytes for v in views),
                              kv_host_bytes=sum(v.kv_host_bytes for v in views),
                              kv_offloads=sum(v.kv_offloads for v in views), steps=sum(v.steps for v in views),
                              turns=sum(v.turns for v in views), max_sequences=self.max_sequences,
                              max_context=self.max_context, prefill_tokens=sum(v.prefill_tokens for v in views),
                              masks=sum(v.masks for v in views), mask_s=sum(v.mask_s for v in views),
                              adapter_slots=sum(v.adapter_slots for v in views),
                              adapters_on_device=sum(v.adapters_on_device for v in views),
                              adapter_loads=sum(v.adapter_loads for v in views),
                              adapter_load_s=sum(v.adapter_load_s for v in views))

    def close(self) -> None:
        self.closed = True  # the replicas' engines close with their replicas


class RemoteAdapters:
    """The adapters of language model ``parent`` on a cluster's replicas, as a server sees
    a model's adapters (NOTE [Adapters on a cluster]): each is read here once, against the
    slots the replicas make (``spec``), so that a bad one is refused before any replica
    reads it; added or removed on every replica, and on those started later."""

    def __init__(self, owner: ClusterRuntime, model: LLMDef, config: Any, dtype: torch.dtype):
        self.parent, self._owner = model.name, owner
        slots = DEFAULT_SLOTS if model.max_loras is None else model.max_loras  # as lm.load makes them
        self.spec = adapter_spec(config, slots, model.max_lora_rank, dtype)
        self.resolve_dir = Path(model.lora_dir) if model.lora_dir is not None else None
        self._pinned = {n for n, _, pinned in model.adapters if pinned}
        self._known: dict[str, KnownAdapter] = {}
        self._lock = threading.Lock()
        for name, path, _ in model.adapters:  # the replicas loaded these at their start
            self._known[name] = self._checked(name, path)

    def _checked(self, name: str, path: str | Path) -> KnownAdapter:
        return KnownAdapter.of(Adapter.read(name, path, self.spec))  # ConfigError: what is wrong with it

    def serves(self, name: str) -> bool:
        """Whether adapter ``name`` is served (added, or read by the resolver)."""
        with self._lock:
            return name in self._known

    def resolvable(self, name: str) -> Path | None:
        return resolvable(self.resolve_dir, name)

    def get(self, name: str) -> str:
        """Adapter ``name`` as a request names it to a replica; one in the resolver's
        directory is checked here on its first request (each replica reads it on its own
        first request). ``UnknownModelError``: none of that name."""
        with self._lock:
            if name in self._known:
                return name
        found = self.resolvable(name)
        if found is None:
            raise UnknownModelError(f"adapter {name!r} is not loaded")
        checked = self._checked(name, found)
        with self._lock:
            self._known.setdefault(name, checked)
        return name

    def add(self, name: str, path: str | Path, pinned: bool = False, replace: bool = False) -> str:
        """Serve adapter ``name`` from ``path`` on every replica (``ConfigError``: it
        cannot be served, or the name is taken and not ``replace``)."""
        check_name(self.parent, name)
        with self._lock:
            before = self._known.get(name)
            if before is not None and not replace:
                raise ConfigError(f"adapter {name!r} is already loaded")
        checked = self._checked(name, path)
        self._owner.adapt(self.parent, name, str(path), pinned, str(before.path) if before is not None else None)
        with self._lock:
            self._known[name] = checked
            if pinned:
                self._pinned.add(name)
        return name

    def remove(self, name: str) -> None:
        with self._lock:
            if name not in self._known:
                raise UnknownModelError(f"adapter {name!r} is not loaded")
        self._owner.adapt(self.parent, name, None)  # a replica's refusal leaves it served
        with self._lock:
            self._known.pop(name, None)
            self._pinned.discard(name)

    def infos(self) -> list[AdapterInfo]:
        """Each adapter, in the slot it has on a replica's device (as of the last poll;
        None: on none)."""
        slots = self._owner.adapter_slots(self.parent)
        with self._lock:
            known, pinned = dict(self._known), set(self._pinned)
        return [AdapterInfo(name, self.parent, str(a.path), a.rank, a.nbytes, slots.get(name), name in pinned)
                for name, a in known.items()]


class RemoteLanguageModel(Texts):
    """Model ``name`` generating on the replicas of ``owner`` (NOTE [Language models on a
    cluster]); its tokenizer here."""

    def __init__(self, owner: ClusterRuntime, spec: LLMDef):
        d = open_directory(spec.name, spec.path, spec.max_context)
        self.name, self.path, self.tokenizer = spec.name, d.path, d.tokenizer
        self._grammars = LLGuidance(d.tokenizer)  # a format is checked here, before a replica runs it
        self.created = int(d.path.stat().st_mtime)
        self._vocab = d.vocab
        self._owner = owner
        self._engine = RemoteEngine(owner, spec.name, spec.max_sequences, d.max_context)
        # NOTE [Adapters on a cluster]: checked here in the dtype the replicas compute in.
        self.adapters = RemoteAdapters(owner, spec, d.config, parse_dtype(spec.dtype) or weights_dtype(
            [str(f) for f in shard_files(d.path)])) if spec.serves_adapters else None

    @property
    def max_context(self) -> int:
        return self._engine.max_context

    @property
    def engine(self) -> RemoteEngine:
        return self._engine

    def generate(self, prompt: list[int], params: SamplingParams,
                 on_event: Callable[[Delta | Finish], None] | None = None,
                 adapter: str | Adapter | None = None) -> RemoteGeneration:
        named = adapter if isinstance(adapter, str) or adapter is None else adapter.name
        if named is not None and (self.adapters is None or not self.adapters.serves(named)):
            raise UnknownModelError(f"model {self.name!r} serves no adapter {named!r}")
        check_prompt(self.name, prompt, params, self._vocab, self.max_context)
        if params.output is not None:  # NOTE [Constrained decoding]: a format that cannot compile is a 400 here
            self._grammars.check(params.output)
        if self._engine.closed:
            raise Unavailable(f"model {self.name!r} is closed")
        return self._owner.generate(self.name, list(prompt), params, on_event, self._engine, named)

    def close(self) -> None:
        self._engine.close()


def relay(events, generation: RemoteGeneration, engine: RemoteEngine, model: str, prompt_tokens: int,
          arrived: float, failed: Callable[[BaseException], BaseException]) -> None:
    """Deliver a replica's stream of events (an iterator that raises if the replica dies,
    or a token is late) to ``generation``, with the token timings for the metrics
    measured here; ``failed`` turns what the stream raised into the generation's error."""
    last = arrived
    sent = 0  # tokens generated so far (a delta carries the count)
    try:
        for event in events:
            now = time.monotonic()
            if isinstance(event, Delta):
                engine.emit(TokenTiming(model, sent == 0, now - last))
                last, sent = now, event.tokens
            generation.put(event)
            if isinstance(event, Finish):
                engine.emit(SequenceDone(model, event))
                return
        error: BaseException = failed(EOFError("the stream ended without a finish"))
    except Exception as exc:
        error = failed(exc)
    finish = Finish("error", prompt_tokens, sent, error)
    generation.put(finish)
    engine.emit(SequenceDone(model, finish))
