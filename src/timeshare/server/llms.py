"""The server's language models (the ``llms`` section of the YAML): loaded and warmed up
at start-up, found by the ``model`` field of OpenAI-style requests, closed at shutdown.
Runs in the server's process; loading runs in the service's pool threads. A model
generates in this process (``llm/model.py``) or on a cluster's replicas
(``cluster/llm.py``): the same ``ServedLLM`` either way."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from timeshare.config import LLMConfig
from timeshare.config.sources import section
from timeshare.errors import ConfigError, Conflict, LoadFailed, Unavailable, UnknownModelError
from timeshare.llm.adapters import Adapter, AdapterInfo
from timeshare.llm.engine import EngineSnapshot
from timeshare.llm.kv_budget import KVBudget
from timeshare.llm.model import LLMDef
from timeshare.llm.pages import PagePool
from timeshare.llm.sampling import SamplingParams
from timeshare.llm.sequence import Delta, Event, Finish
from timeshare.runtime.facade import Runtime
from timeshare.server.status import ModelFailure, failure_of

log = logging.getLogger(__name__)


class Generation(Protocol):
    def cancel(self) -> None: ...

    def result(self, timeout_s: float) -> Any: ...


class EngineView(Protocol):
    def subscribe(self, listener: Callable[[Event], None]) -> None: ...

    def snapshot(self) -> EngineSnapshot: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LLMState:
    """A configured language model as metrics and the status page see it: READY with its
    engine's snapshot, LOADING, or UNAVAILABLE with the reason it failed to load."""

    state: str
    engine: EngineSnapshot | None = None
    reason: str | None = None

    def to_json(self) -> dict:
        """A ready model's state beside its engine's fields; another's beside its reason."""
        if self.engine is not None:
            return {"state": self.state, **dataclasses.asdict(self.engine)}
        return {"state": self.state, "reason": self.reason}


class AdapterTable(Protocol):
    """What the server needs of a language model's LoRA adapters (NOTE [Adapter
    residency]; on a cluster NOTE [Adapters on a cluster]): whether it serves a name, the resolver's
    directory for a name, an adapter as a request passes it to ``generate`` (read there
    if it must be), adding and removing, and what ``/v1/models`` and ``timeshare ps`` show."""

    def serves(self, name: str) -> bool: ...

    def resolvable(self, name: str) -> Path | None: ...

    def get(self, name: str) -> Adapter | str: ...

    def add(self, name: str, path: str | Path, pinned: bool = False, replace: bool = False) -> Adapter | str: ...

    def remove(self, name: str) -> None: ...

    def infos(self) -> list[AdapterInfo]: ...


class ServedLLM(Protocol):
    """What the OpenAI API needs of a language model; ``adapters``: its LoRA adapters
    (None: it serves none)."""

    name: str
    created: int

    @property
    def adapters(self) -> AdapterTable | None: ...

    @property
    def max_context(self) -> int: ...

    @property
    def engine(self) -> EngineView: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...

    def generate(self, prompt: list[int], params: SamplingParams,
                 on_event: Callable[[Delta | Finish], None] | None = None,
                 adapter: str | Adapter | None = None) -> Generation: ...

    def close(self) -> None: ...


def llm_def(cfg: LLMConfig, kv_memory: int | None = None) -> LLMDef:
    """``cfg``'s model as ``lm.load`` registers it, in this process or on every replica of
    a cluster (``kv_memory``: the runtime's budget a replica makes for its caches)."""
    return LLMDef(cfg.name, cfg.path, dtype=cfg.dtype, priority=cfg.priority, max_context=cfg.max_context,
                  max_sequences=cfg.max_sequences, quantum_s=cfg.quantum_ms / 1000, offload_kv=cfg.offload_kv,
                  kv_memory=kv_memory, graphs=cfg.decode_modes[0], compile=cfg.decode_modes[1],
                  prefix_caching=cfg.prefix_caching, multi_step_s=cfg.multi_step_ms / 1000,
                  adapters=tuple((a.name, a.path, a.pinned) for a in cfg.adapters), max_loras=cfg.max_loras,
                  max_lora_rank=cfg.max_lora_rank, lora_dir=cfg.lora_dir, max_cpu_loras=cfg.max_cpu_loras)


def open_local(runtime: Runtime, cfg: LLMConfig, kv_budget: KVBudget | None = None,
               pages: PagePool | None = None) -> ServedLLM:
    """``cfg``'s model generating in this process, on ``runtime``; ``kv_budget`` and
    ``pages``: shared by the runtime's language models (NOTE [Key/value caches under
    pressure], NOTE [Paged key/value caches])."""
    return llm_def(cfg).load(runtime, kv_budget, pages, pin=cfg.pinned)


class LanguageModels:
    def __init__(self, configs: list[LLMConfig], listener: Callable[[Event], None], *, warmup: bool = True):
        self.configs = {c.name: c for c in configs}
        self.warmup = warmup
        self.loaded: dict[str, ServedLLM] = {}
        self.failed: dict[str, ModelFailure] = {}  # NOTE [Permanent and transient failures]
        self.unloaded: set[str] = set()  # unloaded through the admin plane, until loaded again
        self.pinned = {c.name for c in configs if c.pinned}  # kept on the device (config or admin plane)
        self._listener = listener

    async def start(self, open_model: Callable[[LLMConfig], ServedLLM], call: Callable[..., Awaitable]) -> None:
        """Open every model with ``open_model`` (which profiles its prefill) and, with
        ``warmup``, generate a token with it; a model that fails is unavailable, with the
        reason (permanent or transient), and the others serve."""
        for i, cfg in enumerate(self.configs.values(), 1):
            log.info("loading language model %d of %d: %s", i, len(self.configs), cfg.name)  # start-up's progress
            try:
                model = await call(self._load, open_model, cfg)
            except Exception as exc:
                self.failed[cfg.name] = failure_of(exc)
                log.error("language model %s did not load (%s): %s", cfg.name, self.failed[cfg.name].kind.value, exc)
                continue
            self.loaded[cfg.name] = model

    def _load(self, open_model: Callable[[LLMConfig], ServedLLM], cfg: LLMConfig) -> ServedLLM:
        model = open_model(cfg)
        try:
            if self.warmup:
                model.generate(model.encode("warm up") or [0], SamplingParams(max_tokens=1, temperature=0)).result(600)
        except BaseException:
            model.close()
            raise
        model.engine.subscribe(self._listener)
        return model

    def get(self, name: str) -> ServedLLM:
        model = self.loaded.get(name)
        if model is not None:
            return model
        if name in self.unloaded:
            raise LoadFailed(f"model {name!r} was unloaded; load it again (POST /v2/repository/models/{name}/load)")
        failure = self.failed.get(name)
        if failure is not None and failure.permanent:  # no Retry-After: NOTE [Permanent and transient failures]
            raise LoadFailed(f"model {name!r} failed to load and cannot serve until the cause is fixed and the "
                             f"server restarted: {failure.cause}")
        if failure is not None:
            raise Unavailable(f"model {name!r} failed to load: {failure.cause}")
        if name in self.configs:
            raise Unavailable(f"model {name!r} is loading")
        raise UnknownModelError(f"no language model named {name!r}; known: {sorted(self.configs)}")

    # ------------------------------------------------------------------ adapters
    def find(self, name: str) -> tuple[ServedLLM, str | None]:
        """The model a request's ``model`` names, and the adapter it names (NOTE [Adapter
        residency]): a base by its name, or the base of the adapter of that name (loaded,
        or in a base's ``lora_dir``); else ``get``'s errors."""
        if name in self.loaded or name in self.configs:
            return self.get(name), None
        for model in list(self.loaded.values()):
            if model.adapters is not None and (model.adapters.serves(name)
                                               or model.adapters.resolvable(name) is not None):
                return model, name
        return self.get(name), None

    def with_adapters(self, base: str | None) -> ServedLLM:
        """The model whose adapters a run-time load or unload means: ``base``, or the one
        model that serves adapters."""
        if base is not None:
            model = self.get(base)
            if model.adapters is None:
                raise ConfigError(f"model {base!r} serves no adapters (give it max_loras, adapters or lora_dir)")
            return model
        serving = [m for m in self.loaded.values() if m.adapters is not None]
        if len(serving) != 1:
            raise ConfigError("base_model_name is needed: " + (
                "no language model serves adapters (give one max_loras, adapters or lora_dir)" if not serving
                else f"{sorted(m.name for m in serving)} serve adapters"))
        return serving[0]

    def add_adapter(self, name: str, path: str, base: str | None = None, replace: bool = False) -> None:
        """Serve adapter ``name`` from directory ``path`` from now on (read now); with
        ``replace``, in place of the adapter of that name (read first: a bad one leaves
        the old one serving)."""
        model = self.with_adapters(base)
        assert model.adapters is not None
        taken = name in self.configs or any(m.adapters is not None and m.adapters.serves(name) for m in
                                            list(self.loaded.values()))
        if taken and not (replace and model.adapters.serves(name)):
            raise Conflict(f"a model or adapter named {name!r} is served already")
        model.adapters.add(name, path, replace=replace)

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``: new requests for it are 404s."""
        for model in list(self.loaded.values()):
            if model.adapters is not None and model.adapters.serves(name):
                model.adapters.remove(name)
                return
        raise UnknownModelError(f"no adapter named {name!r} is loaded")

    def adapters(self) -> list[AdapterInfo]:
        """Every loaded adapter of every model."""
        return [info for m in list(self.loaded.values()) if m.adapters is not None for info in m.adapters.infos()]

    def snapshot(self) -> dict[str, LLMState]:
        out = {}
        for name in self.configs:
            model = self.loaded.get(name)
            if model is not None:
                out[name] = LLMState("READY", engine=model.engine.snapshot())
            elif name in self.unloaded:
                out[name] = LLMState("UNAVAILABLE", reason="unloaded")
            else:
                failure = self.failed.get(name)
                out[name] = LLMState("UNAVAILABLE" if failure else "LOADING",
                                    reason=None if failure is None else failure.describe())
        return out

    def unready(self) -> dict[str, str]:
        """The language models, not optional, that cannot serve: loading, or why they failed."""
        return {name: self.failed[name].describe() if name in self.failed else "loading"
                for name, cfg in self.configs.items()
                if name not in self.loaded and name not in self.unloaded and not cfg.optional}

    def permanent_failures(self) -> dict[str, str]:
        """The language models, not optional, that failed for good, with the cause."""
        return {name: f.cause for name, f in self.failed.items() if f.permanent and not self.configs[name].optional}

    # ------------------------------------------------------------------ the admin plane
    async def load(self, name: str, open_model: Callable[[LLMConfig], ServedLLM], call: Callable[..., Awaitable]) \
            -> None:
        """Open a configured model that does not serve (unloaded, or failed), as at start-up;
        a Conflict with the cause if it fails again."""
        if name in self.loaded:
            return
        try:
            model = await call(self._load, open_model, self.configs[name])
        except Exception as exc:
            self.failed[name] = failure_of(exc)
            raise Conflict(f"language model {name!r} did not load: {exc}") from exc
        self.failed.pop(name, None)
        self.unloaded.discard(name)
        self.loaded[name] = model

    async def add(self, source: str, name: str | None, open_model: Callable[[LLMConfig], ServedLLM],
                  call: Callable[..., Awaitable]) -> LLMConfig:
        """Serve from now on the language model ``source`` names (a Hugging Face directory,
        or a repository id in the local Hugging Face cache, as ``timeshare serve MODEL``),
        as ``name``; a ConfigError says what ``source`` is not, a Conflict why it did not
        load (and it is not kept)."""
        cfg = await call(section, source, name=name)
        if not isinstance(cfg, LLMConfig):
            raise ConfigError(f"{source}: only language models can be added at run time; a weights file goes "
                              "in the config")
        if cfg.name in self.configs:
            raise Conflict(f"a language model named {cfg.name!r} is served already; give another name")
        self.configs[cfg.name] = cfg
        try:
            await self.load(cfg.name, open_model, call)
        except BaseException:
            del self.configs[cfg.name]
            self.failed.pop(cfg.name, None)
            raise
        return cfg

    def unload(self, name: str) -> None:
        """Stop serving ``name``: its generations end with an error, and its weights and
        caches leave the device and host memory. Readiness no longer waits for it."""
        model = self.loaded.pop(name, None)
        self.unloaded.add(name)
        self.failed.pop(name, None)
        if model is not None:
            model.close()  # its engine's generations end with an error; the runtime unregisters it

    def pin(self, name: str, pinned: bool, runtime: Runtime | None) -> None:
        """Keep ``name`` on the device (loaded now, with a token generated) or let it be
        evicted again; the model must be serving, in this process's runtime."""
        model = self.get(name)
        if runtime is None or not isinstance(runtime, Runtime):
            raise Conflict("language models are pinned in the server's own runtime, not on a cluster")
        runtime.pin(name, pinned)
        if pinned:
            model.generate(model.encode("pin") or [0], SamplingParams(max_tokens=1, temperature=0)).result(600)
            self.pinned.add(name)
        else:
            self.pinned.discard(name)

    def close(self) -> None:
        """Stop generating: queued and running sequences end with an error."""
        for model in self.loaded.values():
            model.engine.close()
