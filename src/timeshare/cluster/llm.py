"""Language models on a cluster's replicas, as a server sees one of its own. Runs in the
front end's process (``RemoteLanguageModel``) and in the replicas (``LLMDef.load``).

NOTE [Language models on a cluster]
Every replica loads every language model of the config into its runtime (its weights in
the host store, loaded onto the device on demand, pipelined, as on one machine) with an
engine of its own; a generation runs whole on one replica, streamed back token by token
through a Ray generator (``Replica.generate``). The front end keeps the tokenizer (read
from the same directory), so prompts are checked and encoded before anything is sent,
and errors about them are the same as on one machine. Which replica generates: the one
that generated for this model last (its weights, and perhaps its turn, are there) while
it has fewer generations of the model in flight than the model decodes together; else
the live replica with the fewest generations in flight. A generation whose replica dies
ends with an error (it is not retried: tokens may have been sent already), and so does
one whose next token does not come within the call deadline. Cancelling one (a client
that leaves) reaches its replica beside whatever it is running, even before the
generation has started there. Generations run in a concurrency group of the replica's
actor of their own, as many as its language models decode together (the sum of their
``max_sequences``); when every live replica has that many, a new one is refused (503).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from timeshare.errors import Unavailable, UnknownModelError
from timeshare.llm.adapters import Adapter, Adapters
from timeshare.llm.constrained import LLGuidance
from timeshare.llm.engine import MULTI_STEP_S, EngineSnapshot
from timeshare.llm.model import Texts, open_directory
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
    from timeshare.runtime.facade import Runtime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LLMDef:
    """A language model every replica loads: a Hugging Face directory every replica can read."""

    name: str
    path: str
    dtype: str | None = None
    priority: str = "latency_critical"
    max_context: int | None = None
    max_sequences: int = 8
    quantum_s: float = 0.05
    offload_kv: bool = False
    # The replica's runtime-wide budget for caches between turns (the same in every
    # LLMDef of a cluster; NOTE [Key/value caches under pressure]); None: no budget.
    kv_memory: int | None = None
    graphs: str = "auto"  # NOTE [Decode graphs]
    compile: str = "auto"  # NOTE [Compiled decode steps]
    prefix_caching: bool = True  # NOTE [Prefix caching]
    multi_step_s: float = MULTI_STEP_S  # NOTE [Multi-step decode]

    def load(self, rt: Runtime, kv_budget=None):
        from timeshare.llm import model as lm

        return lm.load(rt, self.name, self.path, dtype=self.dtype, priority=self.priority,
                       max_context=self.max_context, max_sequences=self.max_sequences, quantum_s=self.quantum_s,
                       offload_kv=self.offload_kv, kv_budget=kv_budget, graphs=self.graphs, compile=self.compile,
                       prefix_caching=self.prefix_caching, multi_step_s=self.multi_step_s)


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
                              masks=sum(v.masks for v in views), mask_s=sum(v.mask_s for v in views))

    def close(self) -> None:
        self.closed = True  # the replicas' engines close with their replicas


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
        self.adapters: Adapters | None = None  # NOTE [Adapter residency]: not on a cluster yet

    @property
    def max_context(self) -> int:
        return self._engine.max_context

    @property
    def engine(self) -> RemoteEngine:
        return self._engine

    def generate(self, prompt: list[int], params: SamplingParams,
                 on_event: Callable[[Delta | Finish], None] | None = None,
                 adapter: str | Adapter | None = None) -> RemoteGeneration:
        if adapter is not None:
            named = adapter if isinstance(adapter, str) else adapter.name
            raise UnknownModelError(f"model {self.name!r} serves no adapters on a cluster (adapter {named!r})")
        check_prompt(self.name, prompt, params, self._vocab, self.max_context)
        if params.output is not None:  # NOTE [Constrained decoding]: a format that cannot compile is a 400 here
            self._grammars.check(params.output)
        if self._engine.closed:
            raise Unavailable(f"model {self.name!r} is closed")
        return self._owner.generate(self.name, list(prompt), params, on_event, self._engine)

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
