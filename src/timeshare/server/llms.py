"""The server's language models (the ``llms`` section of the YAML): loaded and warmed up
at start-up, found by the ``model`` field of OpenAI-style requests, closed at shutdown.
Runs in the server's process; loading runs in the service's pool threads."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from timeshare.config import LLMConfig
from timeshare.errors import Unavailable, UnknownModelError
from timeshare.llm import model as lm
from timeshare.llm.engine import Event
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.facade import Runtime

log = logging.getLogger(__name__)


class LanguageModels:
    def __init__(self, configs: list[LLMConfig], listener: Callable[[Event], None], *, warmup: bool = True):
        self.configs = {c.name: c for c in configs}
        self.warmup = warmup
        self.loaded: dict[str, lm.LanguageModel] = {}
        self.failed: dict[str, str] = {}
        self._listener = listener

    async def start(self, runtime: Runtime, call: Callable[..., Awaitable]) -> None:
        """Load every model (which profiles its prefill) and, with ``warmup``, generate a
        token with it; a model that fails is unavailable, with the reason, and the
        others serve."""
        for cfg in self.configs.values():
            try:
                model = await call(self._load, runtime, cfg)
            except Exception as exc:
                self.failed[cfg.name] = f"{type(exc).__name__}: {exc}"
                log.error("language model %s did not load: %s", cfg.name, exc)
                continue
            self.loaded[cfg.name] = model

    def _load(self, runtime: Runtime, cfg: LLMConfig) -> lm.LanguageModel:
        model = lm.load(runtime, cfg.name, cfg.path, dtype=cfg.dtype, pin=cfg.pinned, priority=cfg.priority,
                        max_context=cfg.max_context, max_sequences=cfg.max_sequences,
                        quantum_s=cfg.quantum_ms / 1000)
        try:
            if self.warmup:
                model.generate(model.encode("warm up") or [0], SamplingParams(max_tokens=1, temperature=0)).result(600)
        except BaseException:
            model.close()
            raise
        model.engine.subscribe(self._listener)
        return model

    def get(self, name: str) -> lm.LanguageModel:
        model = self.loaded.get(name)
        if model is not None:
            return model
        if name in self.failed:
            raise Unavailable(f"model {name!r} failed to load: {self.failed[name]}")
        if name in self.configs:
            raise Unavailable(f"model {name!r} is loading")
        raise UnknownModelError(f"no language model named {name!r}; known: {sorted(self.configs)}")

    def snapshot(self) -> dict:
        out = {}
        for name in self.configs:
            model = self.loaded.get(name)
            if model is not None:
                out[name] = {"state": "READY", **model.engine.snapshot()}
            else:
                out[name] = {"state": "UNAVAILABLE" if name in self.failed else "LOADING",
                             "reason": self.failed.get(name)}
        return out

    def close(self) -> None:
        """Stop generating: queued and running sequences end with an error."""
        for model in self.loaded.values():
            model.engine.close()
