"""Generation for one language model: requests queue as sequences, are prefilled one by
one, and decode together one token per step (continuous batching: sequences join and
leave between steps), every step an operation of the runtime (``ModelTurn.step``, NOTE
[One step, two places] in ``decode/step.py``), so that the model's weights come and go
like any model's (a step of a model not resident loads it, pipelined). The engine keeps
the sequences, their rows' pages (``batch.py``) and their text; the step runs where the
weights are. Runs in the controller: one thread per model, the caller's threads only
queue and read.

NOTE [Decode bursts]: the engine takes the device with ``Runtime.turn`` and runs steps
until its work is done or the turn is contended: a task of a more urgent class waits (a
latency-critical request to another model takes the device between two tokens), or a
due task of its class (another model's request waiting for its first token: a turn
with prefills to do is due since its oldest request arrived, and is ordered by that
deadline before turns that only decode), or any task waits and the turn has lasted
``quantum_s``. Then it gives the device back and queues for the next turn, its
sequences and their caches kept as they are: a preempted generation resumes at the
token where it stopped, and its text is the text it would have had alone. Turns, not
single steps, are the scheduler's unit: models that took turns step by step would
switch, and reload, at every token. Prefills first keeps the time to first token
short when many models are busy: a new request waits for one step of another model,
its load and its prefill, not for the others' turns.

NOTE [Multi-step decode]: a decode step is one runtime call (the turn's bookkeeping, with
workers a message each way) and the engine's work on its tokens, a fixed cost that a small
model's step on the CPU does not hide (a 9 MiB model steps 8 rows in about 5 ms). So when
no request waits to be admitted and no more urgent or due task waits for the device
(which takes it between two steps, NOTE [Decode bursts]), one call runs a burst of steps
(``Step.count``), each feeding the tokens the one before chose, as vLLM's multi-step
scheduling did: as many as
fit ``multi_step_s`` (``multi_step_ms`` of an ``llms`` entry, default 20 ms; 0: one step
a call) at the latest step's time, at most ``MAX_MULTI_STEP``, no more than any row has
positions left, nor than the longest row has tokens left. A model whose steps take longer
than that runs one step a call, as before. The rows' pages for the whole burst are taken
first (too few: one step, with the preemption below); each row's token of step ``j`` is
drawn with its index plus ``j``, so a seeded row gets the tokens it gets step by step.
A row that ends inside a burst (its end-of-sequence token, its length, a stop string) had
the burst's later steps computed for nothing: those tokens are dropped, and only the
positions of its own tokens are ever published (NOTE [Prefix caching]). What it costs:
tokens reach a stream a burst at a time, and a request that arrives during a burst waits
for its end (at most ``multi_step_s``) before its prefill.

NOTE [Preemption under memory pressure]: a prompt whose pages the pool cannot give now
waits while the model's own rows run (their pages come back as they end); alone, it asks
the budget to move other models' caches out (NOTE [Key/value caches under pressure]) and
fails only if even then it cannot fit. A decode step whose rows need a new page and find
none (cached free pages are reclaimed first: NOTE [Prefix caching]) asks the same, then
preempts the row admitted last: its pages go back, its sequence returns to the head of
the queue with the tokens it has, and its next admission prefills its prompt and those
tokens (most of them cached) and goes on from the next token, which its seed and index
decide as before. A row alone that finds no page fails, saying so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from timeshare.decode.step import DecodeCounts, Step, StepKind, StepOutcome, TokenLogprobs
from timeshare.errors import ConfigError, GenerationError, Unavailable, WorkerCrashedError
from timeshare.llm.adapters import Adapter, AdapterSlotsFull, SlotsSnapshot
from timeshare.llm.batch import Batch, Row
from timeshare.llm.constrained import GrammarError, Grammars
from timeshare.llm.kv_budget import KVBudget
from timeshare.llm.pages import KVMemoryError
from timeshare.llm.sampling import SamplingParams, find_stop, held_back
from timeshare.llm.sequence import (
    Delta,
    Detokenizer,
    Event,
    Finish,
    Sequence,
    SequenceDone,
    TokenTiming,
    check_prompt,
)
from timeshare.runtime.dispatch import Ticket
from timeshare.runtime.facade import ModelTurn, Runtime

log = logging.getLogger(__name__)

MAX_MULTI_STEP = 16  # NOTE [Multi-step decode]: the most steps in one runtime call
MULTI_STEP_S = 0.02  # NOTE [Multi-step decode]: a burst's default length (an ``llms`` entry's multi_step_ms: 20)
NAN_LOGITS = "the model's logits for this sequence hold NaN (corrupt weights?): no token is chosen from them"


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """A language model's engine for metrics and status pages: its generations decoding
    and waiting, the bytes of their key/value caches and of those in host memory, the
    times its caches left the device, the steps and turns so far, and its limits."""

    running: int
    waiting: int
    kv_bytes: int
    kv_host_bytes: int
    kv_offloads: int
    steps: int
    turns: int
    max_sequences: int
    max_context: int
    graph_captures: int = 0  # NOTE [Decode graphs]: graphs captured, steps replayed and run eagerly,
    graph_replays: int = 0  # captures dropped because the model was laid out elsewhere
    eager_steps: int = 0
    graph_invalidations: int = 0
    graphs_compiled: int = 0  # NOTE [Compiled decode steps]: captures of a compiled step, and the
    capture_s: float = 0.0  # seconds capturing took, compiling included
    prefix_hits: int = 0  # NOTE [Prefix caching]: full pages of prompts found cached, and not
    prefix_misses: int = 0
    cached_pages: int = 0  # free pages of its pool holding a published prefix (every model of the pool)
    preemptions: int = 0  # NOTE [Preemption under memory pressure]
    lean_steps: int = 0  # of the eager steps, those run by the lean step (NOTE [Lean decode steps])
    decode_calls: int = 0  # the runtime calls its decode steps took (NOTE [Multi-step decode])
    prefill_tokens: int = 0  # positions its prefills computed (not those found cached: NOTE [Prefix caching])
    masks: int = 0  # NOTE [Constrained decoding]: grammar masks computed, and the seconds they took
    mask_s: float = 0.0
    adapter_slots: int = 0  # NOTE [Adapter residency]: its adapter slots (0: it serves none), those holding
    adapters_on_device: int = 0  # an adapter, the adapters copied into them, and the seconds those copies took
    adapter_loads: int = 0
    adapter_load_s: float = 0.0


class Engine:
    """Continuous batching for the model ``name`` of ``runtime`` (NOTE [Decode bursts]).

    ``decode``: token ids to text; ``eos``: the tokens that end a sequence; ``vocab``:
    the number of token ids; ``batch``: its rows on its page pool (``batch.py``);
    ``grammars``: its grammar library (NOTE [Constrained decoding]; None: no request may
    ask for a structured output)."""

    def __init__(self, runtime: Runtime, name: str, *, decode: Callable[[list[int]], str], eos: set[int],
                 vocab: int, max_context: int, max_sequences: int, batch: Batch,
                 quantum_s: float = 0.05, offload_kv: bool = False, kv_budget: KVBudget | None = None,
                 lane_bytes: int | None = None, multi_step_s: float = MULTI_STEP_S, grammars: Grammars | None = None):
        if max_sequences < 1:
            raise ConfigError(f"max_sequences must be at least 1, got {max_sequences}")
        if max_context < 2:
            raise ConfigError(f"max_context must be at least 2, got {max_context}")
        if not multi_step_s >= 0:  # NaN too
            raise ConfigError(f"multi_step_s must be 0 (one step a call) or more seconds, got {multi_step_s}")
        self.name, self.max_context, self.max_sequences, self.quantum_s = name, max_context, max_sequences, quantum_s
        self._rt, self._decode, self._eos, self._vocab = runtime, decode, eos, vocab
        self._grammars = grammars
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # in the order of the batch's rows
        self._batch = batch
        self.counts = DecodeCounts()  # what its steps did (NOTE [Decode graphs])
        self.wants_capture = batch.spec.graphs != "off"  # as the latest step said
        self.preemptions = 0
        self.multi_step_s = multi_step_s  # NOTE [Multi-step decode]
        self._step_s: float | None = None  # the latest decode step's time (a burst's over its steps)
        self._ids = 0
        self._closed = False
        self._listeners: list[Callable[[Event], None]] = []
        self._ticket = Ticket()  # the turn this engine waits for, made due by a new request
        self._admitting: Sequence | None = None  # taken from the queue, not yet in the batch
        self.kv_bytes = 0
        # NOTE [Key/value caches off the device]: with ``offload_kv``, the running rows'
        # caches go to host memory whenever the engine gives the device up with rows left.
        self.offload_kv = offload_kv
        self.kv_host_bytes = 0  # the caches in host memory now
        self.kv_offloads = 0  # times they were moved there
        # NOTE [Key/value caches under pressure]: the caches left on the device between
        # turns, shared out by the budget.
        self._budget = kv_budget
        self.lane_bytes = lane_bytes  # with lanes, what each turn's lane holds (NOTE [Turns in lanes])
        self._in_turn = False  # holds the device: its batch is its thread's alone
        self.last_turn = 0.0  # when its latest turn began (monotonic)
        self.steps = 0
        self.decode_calls = 0
        self.turns = 0
        if kv_budget is not None:
            kv_budget.join(self)
        self._thread = threading.Thread(target=self._loop, name=f"timeshare-llm-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    def submit(self, prompt: list[int], params: SamplingParams,
               on_event: Callable[[Delta | Finish], None] | None = None, adapter: Adapter | None = None) -> Sequence:
        """Queue a generation (with ``adapter``: NOTE [Adapter residency]). A prompt that
        cannot fit is refused here, before it queues."""
        check_prompt(self.name, prompt, params, self._vocab, self.max_context)
        matcher = None
        if params.output is not None:  # NOTE [Constrained decoding]: a format that cannot compile is refused here
            if self._grammars is None:
                raise GrammarError(f"model {self.name!r} has no grammar library for structured outputs")
            matcher = self._grammars.matcher(params.output)
        with self._cond:
            if self._closed:
                raise Unavailable(f"model {self.name!r} is closed")
            self._ids += 1
            seq = Sequence(self._ids, list(prompt), params, Detokenizer(self._decode), on_event)
            seq.matcher = matcher
            seq.adapter = adapter
            self._waiting.append(seq)
            self._cond.notify_all()
        self._ticket.expedite(seq.arrived)  # a turn queued only to decode is now due
        return seq

    def capture_now(self) -> None:
        """Capture the decode graphs now if they are wanted (NOTE [Decode graphs]): at load,
        the model resident and idle; a failure leaves the steps eager."""
        if not self.wants_capture:
            return
        try:
            with self._rt.turn(self.name) as turn:
                self._run(turn, Step(StepKind.CAPTURE, self._batch.spec))
        except Exception as exc:
            self.wants_capture = False
            log.warning("model %s: capturing its decode graphs failed; its steps run eagerly: %s", self.name, exc)

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        self._listeners.append(listener)

    def snapshot(self) -> EngineSnapshot:
        counts = self.counts
        pool = self._batch.pool.snapshot()
        slots = self._batch.adapters.snapshot() if self._batch.adapters is not None else SlotsSnapshot()
        with self._cond:
            return EngineSnapshot(running=len(self._running), waiting=len(self._waiting), kv_bytes=self.kv_bytes,
                                  kv_host_bytes=self.kv_host_bytes, kv_offloads=self.kv_offloads, steps=self.steps,
                                  turns=self.turns, max_sequences=self.max_sequences, max_context=self.max_context,
                                  graph_captures=counts.captures, graph_replays=counts.replays,
                                  eager_steps=counts.eager, graph_invalidations=counts.invalidations,
                                  graphs_compiled=counts.compiled, capture_s=counts.capture_s,
                                  prefix_hits=self._batch.hits, prefix_misses=self._batch.misses,
                                  cached_pages=pool.cached, preemptions=self.preemptions, lean_steps=counts.lean,
                                  decode_calls=self.decode_calls, prefill_tokens=self._batch.prefilled,
                                  masks=self._batch.masks, mask_s=self._batch.mask_s,
                                  adapter_slots=slots.slots, adapters_on_device=slots.on_device,
                                  adapter_loads=slots.loads, adapter_load_s=slots.load_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop: queued and running sequences end with an error (the engine's thread
        fails them as it leaves, at its next step at the latest)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._budget is not None:
            self._budget.leave(self)
        if self._thread.is_alive():
            log.warning("model %s: the engine is still in a step after %g s; it fails its sequences when the "
                        "step ends", self.name, timeout_s)

    # ------------------------------------------------------------------ the engine's thread
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._closed and not self._waiting and not self._running:
                        self._cond.wait(1.0)
                    if self._closed:
                        return
                    # A request waiting for its first token makes the turn due since it arrived.
                    due = min((s.arrived for s in self._waiting), default=None)
                try:
                    with self._rt.turn(self.name, urgent_since=due, ticket=self._ticket,
                                       ephemeral=self.lane_bytes) as turn:
                        with self._cond:
                            self._in_turn, self.last_turn = True, time.monotonic()
                            self.turns += 1
                        try:
                            if self._budget is not None:  # room for this turn's caches, before they come back
                                self._budget.make_room(self, keep=True, incoming=self.kv_host_bytes)
                            with self._cond:
                                self._kv_back()
                            self._turn(turn)
                            if self.offload_kv and self._running:  # preempted with rows left
                                with self._cond:
                                    self._kv_out()
                            elif self._budget is not None and self._running:
                                self._budget.make_room(self, keep=False)
                        finally:
                            with self._cond:
                                self._in_turn = False
                except Exception as exc:  # the turn itself failed: the runtime closed, the model left
                    log.warning("model %s: turn failed: %s", self.name, exc)
                    self._fail_all(exc)
        except BaseException as exc:
            with self._cond:
                self._closed = True  # no one is left to serve a later submit
            self._fail_all(exc)
            raise
        finally:
            self._fail_all(Unavailable(f"model {self.name!r} was closed"))

    @property
    def kv_device_bytes(self) -> int:
        """The bytes of its caches on the device now (none while they are in host memory)."""
        return self._batch.nbytes

    def move_kv_out(self) -> int:
        """NOTE [Key/value caches under pressure]: move the caches to host memory if the
        engine is between turns with caches on the device; the bytes moved (0: it holds
        the device, or has none there). Another engine's thread calls it, in its turn."""
        with self._cond:
            if self._in_turn:
                return 0
            return self._kv_out()

    def give_up_kv(self) -> int:
        """In its own turn, as it ends: move its caches to host memory; the bytes moved."""
        with self._cond:
            return self._kv_out()

    def _kv_out(self) -> int:
        """NOTE [Key/value caches off the device]: the running rows' caches leave the
        device for host memory (page-locked on CUDA), counted in ``kv_host_bytes``, while
        another task has the device; ``_kv_back`` returns them, bit for bit, at the next
        turn. Done before the turn is given back, so the copy is the engine's own time
        (or, under pressure, the time of the engine that needs the room). With the
        condition held; the bytes moved."""
        moved = self._batch.move_out()
        if moved:
            self.kv_host_bytes = self._batch.host_bytes
            self.kv_offloads += 1
            self.kv_bytes = self._batch.nbytes
        return moved

    def _kv_back(self) -> None:
        """The caches back in pages of the pool; if it has too few free, the others'
        caches make room first (NOTE [Key/value caches under pressure])."""
        need = self._batch.host_bytes
        if not need:
            return
        try:
            self._batch.move_in()
        except KVMemoryError:
            if self._budget is None:
                raise
            self._budget.free(self, need)
            self._batch.move_in()
        self.kv_host_bytes = 0
        self.kv_bytes = self._batch.nbytes

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            left = list(self._waiting) + self._running + ([self._admitting] if self._admitting else [])
            self._waiting.clear()
            self._running = []
            self._admitting = None
            self.kv_bytes = 0
            self.kv_host_bytes = 0
        self._batch.clear()
        for seq in left:
            self._fail(seq, exc)

    def _turn(self, turn: ModelTurn) -> None:
        while not self._closed:
            self._admit(turn)
            if not self._running:
                return
            self._step(turn)
            self._drop_finished()
            with self._cond:
                idle = not self._running and not self._waiting
            if idle:
                self._capture(turn)
                return
            if turn.contended(self.quantum_s):
                return

    def _run(self, turn: ModelTurn, step: Step) -> StepOutcome:
        """``step`` in the turn (NOTE [One step, two places]); what it did is counted.
        NOTE [A step outlives its worker]: the rows' pages are in the arena, not in the
        worker that runs the steps, and a step only writes the positions it computes, so
        a step whose worker died (crashed, killed) runs once more, on a new home, and
        loses nothing; a second death fails it."""
        try:
            outcome = turn.step(step)
        except WorkerCrashedError as exc:
            log.warning("model %s: the worker running its %s step died (%s); the step runs again on another",
                        self.name, step.kind.value, exc)
            outcome = turn.step(step)
        self.counts.add(outcome.counts)
        self.wants_capture = outcome.wants_capture
        return outcome

    def _capture(self, turn: ModelTurn) -> None:
        """NOTE [Decode graphs]: resident and idle, with no one waiting for the device:
        capture the decode graphs if they are wanted (never captured where the steps run,
        or dropped after a relayout). A failed capture leaves the steps eager."""
        if not self.wants_capture or turn.contended(0.0):
            return
        try:
            self._run(turn, Step(StepKind.CAPTURE, self._batch.spec))
        except Exception as exc:
            self.wants_capture = False
            log.warning("model %s: capturing its decode graphs failed; its steps stay eager: %s", self.name, exc)

    def _admit(self, turn: ModelTurn) -> None:
        """Prefill waiting sequences into the batch, one at a time, while there is room
        (NOTE [Preemption under memory pressure]). A sequence that fails here (its
        prefill, its first token) fails alone."""
        self._drop_finished()
        # NOTE [Adapter residency]: sequences of adapters with no slot free wait, first in the
        # queue, while those after them that need no new slot are admitted.
        deferred: list[Sequence] = []
        try:
            self._admit_from(turn, deferred)
        finally:
            if deferred:
                with self._cond:
                    self._waiting.extendleft(reversed(deferred))

    def _admit_from(self, turn: ModelTurn, deferred: list[Sequence]) -> None:
        while len(self._running) < self.max_sequences and not self._closed:
            with self._cond:
                seq = self._admitting = self._waiting.popleft() if self._waiting else None
            if seq is None:
                return
            try:
                if seq.cancelled:
                    self._end(seq, "cancelled")
                    continue
                try:
                    made = self._prefill_row(seq)
                except AdapterSlotsFull:
                    if not self._running:  # no row will let a slot go: every slot is pinned
                        raise
                    deferred.append(seq)
                    continue
                if made is None:  # no room until a running row ends: it waits, first in the queue
                    with self._cond:
                        self._waiting.appendleft(seq)
                    return
                row, step = made
                try:
                    try:
                        outcome = self._run(turn, step)
                    finally:
                        self._batch.settle(row)  # NOTE [Adapters streamed in]: its slot written whole
                    token = outcome.tokens[0]
                    if token < 0:
                        raise GenerationError(NAN_LOGITS)
                except BaseException:
                    self._batch.abandon(row)
                    raise
                if outcome.prompt_logprobs:
                    seq.prompt_logprobs = outcome.prompt_logprobs[0]
                if seq.params.max_tokens == 0:  # the prompt scored, nothing generated: its row goes
                    self._batch.abandon(row)
                    seq._put(Delta("", 0, prompt_logprobs=seq.prompt_logprobs))
                    self._end(seq, "length")
                    continue
                self._batch.joined(row)
                with self._cond:
                    self._running.append(seq)
                    self.kv_bytes = self._batch.nbytes
                self._emit(seq, token, outcome.logprobs[0] if outcome.logprobs else None)
                if seq.done:  # its first token ended it: its row goes now
                    self._drop_finished()
            except Exception as exc:
                self._fail(seq, exc)
            finally:
                self._admitting = None

    def _prefill_row(self, seq: Sequence) -> tuple[Row, Step] | None:
        """The row and prefill step of ``seq``; None: the pool has no room now but will
        when running rows end. ``KVMemoryError``: it cannot get the room."""
        batch = self._batch
        need = batch.pages_for(len(seq.prompt) + len(seq.tokens))
        if need > batch.pool.pages - 1:
            raise KVMemoryError(f"model {self.name!r}: a prompt of {len(seq.prompt) + len(seq.tokens)} tokens needs "
                                f"{need} pages of its key/value page pool, which has {batch.pool.pages - 1}: raise "
                                "kv_memory")
        try:
            return batch.prefill(seq)
        except KVMemoryError:
            if self._running:
                return None
            if self._budget is None:
                raise
        self._budget.free(self, need * batch.pool.page_bytes)  # the others' caches make room
        return batch.prefill(seq)

    def _step(self, turn: ModelTurn) -> None:
        """One decode step of every running sequence, or a burst of them (NOTE [Multi-step
        decode]). A failed step fails the batch (every one of them was in it); NaN logits
        fail their sequence alone."""
        count = self._burst(turn)
        if count > 1 and self._batch.short(count):
            count = 1  # too few pages for the burst: one step, preempting if it must
        if count == 1 and not self._room():
            return
        rows = len(self._running)
        try:
            started = time.perf_counter()
            outcome = self._run(turn, self._batch.decode(count))
            if len(outcome.tokens) != count * rows:
                raise GenerationError(f"a decode step of {rows} sequences and {count} tokens each gave "
                                      f"{len(outcome.tokens)} tokens")
            self._step_s = (time.perf_counter() - started) / count
        except Exception as exc:
            self._fail_rows(exc)
            return
        self.steps += count
        self.decode_calls += 1
        logprobs = outcome.logprobs or (None,) * len(outcome.tokens)
        for j in range(count):
            part = slice(j * rows, (j + 1) * rows)
            for seq, token, lp in zip(self._running, outcome.tokens[part], logprobs[part]):
                if seq.done:  # it ended earlier in the burst: its later tokens are not its
                    continue
                try:
                    if token < 0:
                        raise GenerationError(NAN_LOGITS)
                    self._emit(seq, token, lp)
                except Exception as exc:  # or a tokenizer's error
                    self._fail(seq, exc)
        self._batch.stepped(count)
        self.kv_bytes = self._batch.nbytes

    def _burst(self, turn: ModelTurn) -> int:
        """How many decode steps the next runtime call runs (NOTE [Multi-step decode]):
        one while a request waits to be admitted, while a more urgent or a due task
        waits for the device (NOTE [Decode bursts]), or before a step was timed; else as
        many as fit ``multi_step_s`` at the latest step's time, no more than any row has
        positions left or the longest has tokens left to make."""
        if self.multi_step_s <= 0 or self._step_s is None or turn.contended(float("inf")):
            return 1
        if any(seq.matcher is not None for seq in self._running):
            return 1  # NOTE [Constrained decoding]: each mask depends on the token before it
        with self._cond:
            if self._waiting:
                return 1
        count = min(MAX_MULTI_STEP, int(self.multi_step_s / max(self._step_s, 1e-6)))
        if count <= 1:
            return 1
        room = min(self.max_context - row.length for row in self._batch.rows)
        left = max(seq.params.max_tokens - len(seq.tokens) for seq in self._running)
        return max(1, min(count, room, left))

    def _room(self) -> bool:
        """A page for every row's next position (NOTE [Preemption under memory pressure]):
        the others' caches make room, then the rows admitted last are preempted; False if
        no row is left to step."""
        short = self._batch.short()
        if short and self._budget is not None:
            self._budget.free(self, len(short) * self._batch.pool.page_bytes)
            short = self._batch.short()
        while short:
            if len(self._running) == 1:
                self._fail_rows(KVMemoryError(
                    f"model {self.name!r}: its key/value page pool has no page left for the sequence's position "
                    f"{self._batch.rows[0].length}: raise kv_memory or lower max_sequences"))
                return False
            victim = len(self._running) - 1
            with self._cond:
                seq = self._running.pop(victim)
                self._waiting.appendleft(seq)
            self._batch.keep(list(range(victim)))
            self.preemptions += 1
            log.info("model %s: no page for every row; sequence %d waits for room (%d tokens so far)", self.name,
                     seq.id, len(seq.tokens))
            short = self._batch.short()
        return bool(self._running)

    def _fail_rows(self, exc: BaseException) -> None:
        """The batch is lost: every running sequence fails with ``exc``."""
        with self._cond:
            failed, self._running, self.kv_bytes = self._running, [], 0
        self._batch.clear()
        for seq in failed:
            self._fail(seq, exc)

    def _drop_finished(self) -> None:
        for seq in self._running:
            if seq.cancelled and not seq.done:
                self._end(seq, "cancelled")
        rows = [i for i, s in enumerate(self._running) if not s.done]
        if len(rows) != len(self._running):
            with self._cond:
                self._running = [self._running[i] for i in rows]
            self._batch.keep(rows)
            self.kv_bytes = self._batch.nbytes

    # ------------------------------------------------------------------ one token
    def _emit(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> None:
        now = time.monotonic()
        first = seq.first_token_at is None
        self._tell(TokenTiming(self.name, first, now - (seq.arrived if first else seq.last_token_at)))  # type: ignore[operator]
        if first:
            seq.first_token_at = now
        seq.last_token_at = now
        seq.tokens.append(token)
        if seq.params.logprobs is not None:
            seq.logprobs.append(logprobs)
        reason = None
        if seq.matcher is not None and not seq.matcher.accept(token):  # the mask allowed it: a bug if not
            raise GenerationError(f"token {token} broke sequence {seq.id}'s grammar")
        early = len(seq.tokens) < seq.params.min_tokens  # no stop yet (its end tokens were not drawable)
        if token in self._eos and not early:
            reason = "stop"
            seq.text += seq.detokenizer.flush()
        else:
            before = len(seq.text)
            seq.text += seq.detokenizer.add(token)
            # Text still being decoded (a character's first bytes) is not in ``text`` yet.
            at = None if early else find_stop(seq.text, seq.params.stop, before)
            if at is not None:
                seq.text, reason = seq.text[:at], "stop"
        if reason is None and seq.matcher is not None and seq.matcher.done():  # its grammar is complete
            reason = "stop"
            seq.text += seq.detokenizer.flush()
        if reason is None and (len(seq.tokens) >= seq.params.max_tokens
                               or len(seq.prompt) + len(seq.tokens) >= self.max_context):
            reason = "length"
            seq.text += seq.detokenizer.flush()
        upto = len(seq.text) if reason else len(seq.text) - held_back(seq.text, seq.params.stop)
        if upto > seq.sent or (reason and len(seq.tokens) > seq.sent_tokens):
            ids = tuple(seq.tokens[seq.sent_tokens:])
            seq._put(Delta(seq.text[seq.sent:upto], len(seq.tokens), ids,
                           tuple(seq.logprobs[seq.sent_tokens:]) if seq.params.logprobs is not None else (),
                           seq.prompt_logprobs if seq.sent_tokens == 0 else None))
            seq.sent, seq.sent_tokens = upto, len(seq.tokens)
        if reason:
            self._end(seq, reason)

    def _end(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        if seq.done:
            return
        seq.finish = Finish(reason, len(seq.prompt), len(seq.tokens), error)
        seq._put(seq.finish)
        self._tell(SequenceDone(self.name, seq.finish))

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        self._end(seq, "error", exc)

    def _tell(self, event: Event) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not stop generation
                log.exception("llm listener failed")

