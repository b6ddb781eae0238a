"""What a running server holds, model by model, as ``ollama ps`` shows it: each model and
language model with its state, the device bytes it holds now, whether it is pinned, when
it last ran and what waits for it, and each LoRA adapter with the slot it has on the
device (``/admin/ps``, read by ``timeshare ps``). Read from
the server's snapshot, without waiting for the device. Runs in the server's process.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI

if TYPE_CHECKING:
    from timeshare.server.service import Service


@dataclass(frozen=True, slots=True)
class ModelRow:
    """One served model as an operator sees it."""

    name: str
    kind: str  # "model" (the Open Inference Protocol) or "language model" (the OpenAI API)
    state: str  # READY, LOADING, UNAVAILABLE...
    device_bytes: int | None  # held on the device now; None: not resident
    pinned: bool
    last_used_s: float | None  # seconds since its latest call ended; None: none yet
    waiting: int  # requests queued (a language model: generations waiting for a place)
    running: int  # a language model's generations decoding; a model's: 0


def rows(service: Service, now: float | None = None) -> list[ModelRow]:
    """Every configured model and language model, in the config's order."""
    now = time.time() if now is None else now
    snap = service.snapshot()
    resident = {} if snap.runtime is None else snap.runtime.resident
    last = service.last_used

    def ago(name: str) -> float | None:
        at = last.get(name)
        return None if at is None else max(0.0, now - at)

    out = [ModelRow(ep.name, "model", ep.state.value, resident.get(ep.name), ep.pinned, ago(ep.name),
                    snap.queue_depth.get(ep.name, 0), 0)
           for ep in service.endpoints.values()]
    for cfg in list(service.llms.configs.values()):
        llm = snap.llms.get(cfg.name)
        engine = None if llm is None else llm.engine
        out.append(ModelRow(cfg.name, "language model", "LOADING" if llm is None else llm.state,
                            resident.get(cfg.name), cfg.name in service.llms.pinned, ago(cfg.name),
                            0 if engine is None else engine.waiting, 0 if engine is None else engine.running))
    return out


def add_ps_route(app: FastAPI, service: Service, guard: list) -> None:
    """``/admin/ps`` behind the admin plane's guard."""

    @app.get("/admin/ps", dependencies=guard,
             summary="Each model: state, device bytes, pinned, last use, queue; each adapter: its slot")
    def ps():
        return {"models": [dataclasses.asdict(r) for r in rows(service)],
                "adapters": [dataclasses.asdict(a) for a in service.llms.adapters()]}  # NOTE [Adapter residency]
