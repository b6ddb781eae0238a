"""Where a language model's decode batch lives, as the engine sees it: in this process
(``PagedCaches``, an in-process runtime) or in the model's home worker (``RemoteCaches``,
``Runtime(workers=N)``). Both prefill a sequence into the batch, decode a step of every
row (each returns the next tokens), and drop rows; the engine (``engine.py``) does not know which it has. Runs in the
controller.

# NOTE [Generation in worker processes]
With workers, a language model's caches live where its model computes: in one worker,
the batch's *home*, chosen when the batch starts (the least used worker, not the first
while there are others), as a training job's state does. The controller keeps the
sequences (tokens, text, sampling) and how many rows the batch has; each step is a
runtime call whose ``RunModel`` carries a ``KVStep`` (the prompt or each row's last
token, the id of every row the controller holds, whether the batch starts afresh) and
goes to the home, which
loads the model if need be (pipelined, like any load), runs the step on the caches it
keeps (``worker/generation.py``) and answers with the logits only: the caches never
cross the pipe. Rows that end are dropped with the next step (the home keeps exactly
the rows it is sent, by id, so a step it never saw, failed on the way, cannot shift one
sequence's cache under another's tokens; a row it lacks loses the batch), or at once
(``DropCaches``) when none is left, so an idle model holds no cache. A prefill that
fails joins nothing and fails its sequence alone; a decode step that fails loses the
batch, in the home too (told again by the controller), and fails its rows. A home that
dies takes the caches with it, and a home that dropped a batch says so
(``BatchLostError``): the rows in it fail with ``CachesLostError`` saying so, and the
next sequence (one already queued too) starts a batch afresh. Caches a prefill could not
bring back from host memory stay there for the next step.
``offload_kv`` and ``kv_memory`` move a batch's caches to the home's host memory
(``OffloadCaches``); the home brings them back before the batch's next step.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch

from timeshare.errors import BatchLostError, GenerationError, WorkerCrashedError, WorkerError, WorkerTimeoutError
from timeshare.llm.sampling import next_token
from timeshare.llm.sequence import Sequence
from timeshare.protocol import KVStep
from timeshare.runtime.facade import ModelTurn, Runtime
from timeshare.worker.decoding import DecodeCounts, DecodeRunner, Draw
from timeshare.worker.paged import KVMemoryError

log = logging.getLogger(__name__)
_ids = itertools.count(1)


class CachesLostError(WorkerError):
    """The worker that kept a batch's caches failed: every row in it is lost."""


NAN_LOGITS = "the model's logits for this sequence hold NaN (corrupt weights?): no token is chosen from them"


class PagedCaches:
    """The batch in this process, on paged caches (``worker/decoding.py``): each step is
    a runtime call of the model that runs the runner's step (NOTE [Decode graphs]), the
    next tokens chosen on the device."""

    def __init__(self, runner: DecodeRunner):
        self.runner = runner
        self._saved: tuple[torch.Tensor, list[int]] | None = None  # the caches while in host memory
        # NOTE [Key/value caches under pressure]: with a pool shared under a budget, what
        # frees pages (other models' caches to host memory) when a step finds none.
        self.on_full: Callable[[int], int] | None = None

    @property
    def out(self) -> bool:
        """Whether the caches are in host memory (NOTE [Key/value caches off the device])."""
        return self._saved is not None

    def move_out(self) -> int:
        """Move the caches to host memory (page-locked on CUDA); the bytes moved."""
        if self._saved is not None or not len(self.runner):
            return 0
        nbytes = self.runner.nbytes
        self._saved = self.runner.move_out()
        return nbytes if self._saved is not None else 0

    def move_back(self) -> None:
        """The caches back in pages of the pool, bit for bit."""
        if self._saved is None:
            return
        try:
            self.runner.move_in(self._saved)
        except KVMemoryError:  # the pool is full: the others' caches make room (NOTE [Paged key/value caches])
            if self.on_full is None:
                raise
            self.on_full(sum(self._saved[1]) * self.runner.layout.pool.page_bytes)
            self.runner.move_in(self._saved)
        self._saved = None

    @property
    def nbytes(self) -> int:
        return 0 if self._saved is not None else self.runner.nbytes

    @property
    def counts(self) -> DecodeCounts:
        return self.runner.counts

    def prefill(self, turn: ModelTurn, seq: Sequence) -> int:
        step = self.runner.prefill(seq.prompt, draw([seq]))
        need = self.runner.layout.pages_for(len(seq.prompt))
        token = int(self._call(turn, step, need).output[0])
        if token < 0:  # its row joined: it leaves again, its pages back in the pool
            self.runner.keep(list(range(len(self.runner) - 1)))
            raise GenerationError(NAN_LOGITS)
        return token

    def decode(self, turn: ModelTurn, seqs: list[Sequence]) -> list[int | Exception]:
        """Each row's next token, or the error of a row whose logits were NaN (its alone)."""
        step = self.runner.decode([s.tokens[-1] for s in seqs], draw(seqs))
        return [GenerationError(NAN_LOGITS) if t < 0 else int(t)
                for t in self._call(turn, step, len(seqs)).output.tolist()]

    def _call(self, turn: ModelTurn, step: Callable, pages: int):
        """The step; if the pool has no page for it, once more after ``on_full`` made room
        for ``pages`` pages (a step that found no page changed nothing)."""
        try:
            return turn.call((), {"paged": step})
        except KVMemoryError:
            if self.on_full is None:
                raise
        self.on_full(pages * self.runner.layout.pool.page_bytes)
        return turn.call((), {"paged": step})

    def capture(self, turn: ModelTurn) -> int:
        """Capture the decode graphs if they are wanted (the model resident and idle)."""
        if not self.runner.wants_capture:
            return 0
        return int(turn.call((), {"paged": self.runner.capture()}).output)

    def keep(self, rows: list[int]) -> None:
        if self._saved is not None and len(rows) != len(self.runner):
            self.move_back()  # rows leave while the caches are out: back first, then cut
        self.runner.keep(rows)

    def reset(self) -> None:
        self._saved = None
        self.runner.clear()

    def clear(self) -> None:
        """Every row is gone: so is the batch."""
        self.reset()


def draw(seqs: list[Sequence]) -> Draw:
    """How each sequence chooses its next token (its params, its seed, its token's index)."""
    return Draw(tuple(s.params.temperature for s in seqs), tuple(s.params.top_k for s in seqs),
                tuple(s.params.top_p for s in seqs), tuple(s.seed for s in seqs), tuple(len(s.tokens) for s in seqs))


class RemoteCaches:
    """The batch in the model's home worker (NOTE [Generation in worker processes])."""

    def __init__(self, runtime: Runtime, name: str):
        self._rt = runtime
        self.key = f"{name}#{next(_ids)}"  # one engine's batch, whatever else shares the name
        self._rows: list[int] = []  # each row's id, in order: sent with every step (``KVStep.rows``)
        self._row_ids = itertools.count(1)
        self.nbytes = 0
        self.out = False  # the caches are in the home's host memory (page-locked on CUDA)

    @property
    def rows(self) -> int:
        return len(self._rows)

    @property
    def counts(self) -> DecodeCounts:
        """A worker's batch decodes eagerly; its steps are not counted here."""
        return DecodeCounts()

    def move_out(self) -> int:
        """Ask the home to move the caches to its host memory; the bytes moved. They
        come back there, before the next step."""
        if self.rows == 0 or self.out:
            return 0
        try:
            moved = self._rt.offload_caches(self.key)
        except WorkerError as exc:  # the home is busy or gone: they stay (or are lost with it)
            log.warning("moving the caches of %s to host memory: %s", self.key, exc)
            return 0
        self.out = moved > 0
        return moved

    def move_back(self) -> None:
        self.out = False  # the home brings them back itself with the next step

    def prefill(self, turn: ModelTurn, seq: Sequence) -> int:
        row = next(self._row_ids)
        try:
            logits = self._step(turn, "prefill", seq.prompt, row)
        except CachesLostError:
            raise
        except BaseException:
            if not self._rows:  # a fresh batch: the home may hold the row it failed after
                self._drop_quietly()
            raise
        self._rows.append(row)
        return next_token(logits, seq.params, seq.generator)

    def decode(self, turn: ModelTurn, seqs: list[Sequence]) -> list[int | Exception]:
        """Each row's next token, chosen here from the logits the home sends (or the
        error choosing it: that sequence's alone)."""
        try:
            logits = self._step(turn, "decode", [s.tokens[-1] for s in seqs])
            if logits.shape[0] != len(seqs):
                raise GenerationError(f"a decode step of {len(seqs)} sequences gave {logits.shape[0]} rows")
        except BaseException:
            # The batch is lost: its rows fail. The home drops it when the step failed
            # there; it is told to here as well (a failure before the step reached it).
            self.reset()
            self._drop_quietly()
            raise
        tokens: list[int | Exception] = []
        for seq, row in zip(seqs, logits):
            try:
                tokens.append(next_token(row, seq.params, seq.generator))
            except Exception as exc:  # NaN logits under sampling: that sequence fails alone
                tokens.append(exc)
        return tokens

    def capture(self, turn: ModelTurn) -> int:
        return 0  # NOTE [Generation in worker processes]: a worker's batch decodes eagerly

    def _drop_quietly(self) -> None:
        try:
            self._rt.drop_caches(self.key)
        except Exception:
            log.exception("dropping the caches of %s after a failed step", self.key)

    def keep(self, rows: list[int]) -> None:
        """Keep these rows (indices into the batch): the home drops the others with the
        next step, or now if none is left."""
        self._rows = [self._rows[i] for i in rows]
        if not rows:  # nothing left: free the caches in the home now, not at the next step
            self.nbytes = 0
            self._rt.drop_caches(self.key)

    def reset(self) -> None:
        self._rows, self.nbytes, self.out = [], 0, False

    def clear(self) -> None:
        """Every row is gone: so is the batch, freed in the home too if it held any."""
        if self.rows:
            self.keep([])
        self.reset()

    def _step(self, turn: ModelTurn, kind: str, tokens: list[int], new: int | None = None) -> torch.Tensor:
        step = KVStep(self.key, kind, tuple(tokens), rows=tuple(self._rows), new=new, fresh=not self._rows)
        try:
            call = turn.call((), {}, kv=step)
        except (WorkerCrashedError, WorkerTimeoutError, BatchLostError) as exc:
            # The home was replaced, or dropped the batch (``worker/generation.py``): its caches are gone.
            self.reset()
            raise CachesLostError(f"the key/value caches of {self.key!r} were lost: {exc}",
                                  where=getattr(exc, "where", "")) from exc
        timings = call.record.timings
        self.nbytes = int(timings.kv_bytes or 0) if timings is not None else 0
        return call.output["logits"]
