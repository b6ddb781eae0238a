"""A language model served by the runtime: a Hugging Face directory registered as one
of the runtime's models (its weights in the host store and the arena like any other's),
its tokenizer and chat template, and the engine that generates from it."""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from timeshare.decode.lora import LoraStacks
from timeshare.decode.pages import MAX_BLOCK, page_bytes_for, pool_footprint
from timeshare.decode.runner import resolve_modes
from timeshare.decode.step import DecoderSpec, KVShape
from timeshare.dtypes import parse_dtype
from timeshare.errors import ConfigError, UnknownModelError
from timeshare.llm import hfdir
from timeshare.llm.adapters import DEFAULT_MAX_RANK, DEFAULT_SLOTS, Adapter, Adapters, AdapterSlots, adapter_spec
from timeshare.llm.batch import Batch
from timeshare.llm.constrained import LLGuidance
from timeshare.llm.engine import MULTI_STEP_S, Engine
from timeshare.llm.kv_budget import KVBudget
from timeshare.llm.pages import PagePool
from timeshare.llm.sampling import SamplingParams
from timeshare.llm.sequence import Delta, Finish, Sequence
from timeshare.memory.ephemeral import lane_bytes
from timeshare.options import serves_adapters
from timeshare.runtime.facade import Runtime
from timeshare.scheduler.task import Priority

log = logging.getLogger(__name__)

PROFILE_TOKENS = 32  # the prompt length a model's prefill is profiled (and its loads planned) for


class Texts:
    """Text to token ids and back with a model's tokenizer and chat template: the same for
    a model generating here and one generating on a cluster's replica."""

    name: str
    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt of a chat: the messages (and the ``tools`` offered, NOTE [Tool calls])
        through the model's chat template, with the assistant's turn opened."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"model {self.name!r} has no chat template; use completions")
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template's own checks (jinja's exceptions)
            raise ConfigError(f"model {self.name!r}: the messages do not fit its chat template ({exc})") from None
        return self.encode(text)

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))


class LanguageModel(Texts):
    """Model ``name`` of ``runtime``, from the directory ``path`` (see ``load``);
    ``region``: the region of the arena its own page pool takes, if it has one."""

    def __init__(self, runtime: Runtime, name: str, path: Path, tokenizer, config, engine: Engine, batch: Batch,
                 region: str | None = None, adapters: Adapters | None = None):
        self.runtime, self.name, self.path = runtime, name, path
        self.tokenizer, self.config, self.engine = tokenizer, config, engine
        self.pages = batch.pool
        self._tag = batch.tag
        self.region = region
        self.adapters = adapters  # NOTE [Adapter residency]: None: served without adapter slots
        self.created = int(path.stat().st_mtime)

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def generate(self, prompt: list[int], params: SamplingParams,
                 on_event: Callable[[Delta | Finish], None] | None = None,
                 adapter: str | Adapter | None = None) -> Sequence:
        """Queue a generation, with adapter ``adapter``, by name or as ``adapters.get``
        gave it (NOTE [Adapter residency]; ``UnknownModelError``: no such adapter)."""
        if adapter is None:
            return self.engine.submit(prompt, params, on_event)
        if self.adapters is None:
            raise UnknownModelError(f"model {self.name!r} serves no adapters (adapter {adapter!r} asked)")
        return self.engine.submit(prompt, params, on_event,
                                  self.adapters.get(adapter) if isinstance(adapter, str) else adapter)

    def close(self) -> None:
        """Stop generating (queued and running sequences fail), forget its cached prefixes
        (NOTE [Prefix caching]), unregister the model and give its page pool's region back
        (after unregistering, which waits for a step still running: a step writes into
        the region)."""
        self.engine.close()
        self.pages.forget(self._tag)
        if self.name in self.runtime.models():
            self.runtime.unregister(self.name)
        if self.region is not None:
            self.runtime.unreserve(self.region)
        if self.adapters is not None:
            self.adapters.slots.close()  # no slot written after its region goes
            self.runtime.unreserve(adapter_region(self.name))


@dataclass(frozen=True)
class LLMDef:
    """A language model's load as a record: a Hugging Face directory and the options of
    ``load`` (a server's ``llms`` entry, made from its config in one place,
    ``server/llms.py``; on a cluster sent to every replica, whose directories every
    replica can read: NOTE [Language models on a cluster])."""

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
    # NOTE [Adapter residency]: its LoRA adapters as (name, directory, pinned), and the
    # options that serve them (on a cluster NOTE [Adapters on a cluster]).
    adapters: tuple[tuple[str, str, bool], ...] = ()
    max_loras: int | None = None
    max_lora_rank: int = DEFAULT_MAX_RANK
    lora_dir: str | None = None
    max_cpu_loras: int | None = None

    @property
    def serves_adapters(self) -> bool:
        return serves_adapters(len(self.adapters), self.max_loras, self.lora_dir, self.max_cpu_loras)

    def with_adapter(self, name: str, path: str | None, pinned: bool = False) -> LLMDef:
        """This model with adapter ``name`` served from ``path`` (None: not served), pinned
        or not (``ReplicaSet.adapt`` keeps a replaced adapter's pin, as on one machine)."""
        kept = tuple(a for a in self.adapters if a[0] != name)
        return replace(self, adapters=kept if path is None else (*kept, (name, path, pinned)))

    def load(self, rt: Runtime, kv_budget: KVBudget | None = None, pages: PagePool | None = None,
             pin: bool = False) -> LanguageModel:
        """``load`` with these options; ``kv_budget`` and ``pages``: shared by the
        runtime's language models; ``pin``: kept on the device."""
        return load(rt, self.name, self.path, dtype=self.dtype, pin=pin, priority=self.priority,
                    max_context=self.max_context, max_sequences=self.max_sequences, quantum_s=self.quantum_s,
                    offload_kv=self.offload_kv, kv_budget=kv_budget, pages=pages, graphs=self.graphs,
                    compile=self.compile, prefix_caching=self.prefix_caching, multi_step_s=self.multi_step_s,
                    adapters={n: p for n, p, _ in self.adapters}, max_loras=self.max_loras,
                    max_lora_rank=self.max_lora_rank, lora_dir=self.lora_dir, max_cpu_loras=self.max_cpu_loras,
                    pinned_adapters=[n for n, _, pinned in self.adapters if pinned])


_loads = itertools.count(1)


def load(runtime: Runtime, name: str, path: str | Path, *, dtype: str | None = None, pin: bool = False,
         priority: Priority | str = Priority.LATENCY_CRITICAL, max_context: int | None = None,
         max_sequences: int = 8, quantum_s: float = 0.05, profile: bool = True,
         offload_kv: bool = False, kv_budget: KVBudget | None = None, pages: PagePool | None = None,
         graphs: str = "auto", compile: str | Callable[..., Any] = "auto",
         prefix_caching: bool = True, multi_step_s: float = MULTI_STEP_S,
         adapters: Mapping[str, str | Path] | None = None, max_loras: int | None = None,
         max_lora_rank: int = DEFAULT_MAX_RANK, lora_dir: str | Path | None = None,
         max_cpu_loras: int | None = None, pinned_adapters: Collection[str] = ()) -> LanguageModel:
    """Register the Hugging Face directory ``path`` as model ``name``: its module built
    from ``config.json``, its weights read from the safetensors shards into the runtime's
    host store, its tokenizer and chat template loaded; generation ready, in-process or
    with workers alike (NOTE [One step, two places]). ``max_context``: the longest prompt
    plus completion (default: the model's positions); ``max_sequences``: sequences decoded
    together; ``quantum_s``: NOTE [Decode bursts]; ``offload_kv``: NOTE [Key/value caches
    off the device]; ``kv_budget``: shared by the runtime's language models, NOTE
    [Key/value caches under pressure]; ``pages``: the pool of key/value pages it shares
    with other models (``arena_pool``; default: a pool of its own for ``max_sequences``
    sequences of ``max_context`` positions, at most ``DEFAULT_POOL_BYTES``, in a region
    of the runtime's arena: NOTE [Regions of the arena]), NOTE [Paged key/value caches];
    ``graphs``: NOTE [Decode graphs] ("auto": captured on CUDA, off elsewhere);
    ``compile``: NOTE [Compiled decode steps] ("auto": inductor where graphs are captured
    on CUDA, "off" to capture transformers' eager step); ``prefix_caching``: NOTE [Prefix
    caching]; ``multi_step_s``: NOTE [Multi-step decode]; ``adapters`` (name -> PEFT
    directory), ``max_loras`` (adapters on the device at once; default ``DEFAULT_SLOTS``
    when it serves any), ``max_lora_rank``, ``lora_dir`` (where the resolver looks for
    an adapter a request names), ``max_cpu_loras`` (adapters in host memory at most;
    None: no bound) and ``pinned_adapters`` (kept on the device): NOTE [Adapter
    residency]. With ``profile``, the model is
    loaded once now and its prefill profiled, so that every load after is pipelined
    (without it, the first generation's load profiles), and its decode graphs are
    captured."""
    d = open_directory(name, path, max_context)
    path, config, tokenizer, context, vocab, eos = d.path, d.config, d.tokenizer, d.max_context, d.vocab, d.eos
    graph_mode, compiled = resolve_modes(graphs, compile, runtime.device)
    example = torch.arange(min(PROFILE_TOKENS, context - 1), dtype=torch.long)[None] % vocab
    # The shards themselves: read now, or under a host budget only when a load needs them.
    shards = [str(f) for f in hfdir.shard_files(path)]
    runtime.register(name, functools.partial(hfdir.build_causal_lm, str(path)), shards,
                     (example,), example_kwargs={"use_cache": False}, dtype=dtype, pin=pin, priority=priority)
    prefill_peak = 0
    if profile:
        try:  # a prefill of PROFILE_TOKENS: the costs its pipelined loads are planned with
            prefill_peak = runtime.profile(name).ephemeral_bytes
        except BaseException:
            runtime.unregister(name)
            raise

    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens, skip_special_tokens=True))

    region = None
    served: Adapters | None = None
    try:
        shape = KVShape.of(config, parse_dtype(dtype) or hfdir.weights_dtype(shards))  # the dtype it computes in
        if pages is None:  # a pool of its own, in the arena
            region = pool_region(name)
            page_bytes, nbytes = pool_bytes(shape, max_sequences, int(context))
            pages = arena_pool(runtime, region, nbytes, page_bytes)
        lora = None
        if serves_adapters(len(adapters or {}), max_loras, lora_dir, max_cpu_loras):  # NOTE [Adapter residency]
            served = adapter_slots(runtime, name, config, shape.dtype,
                                   DEFAULT_SLOTS if max_loras is None else max_loras, max_lora_rank,
                                   lora_dir, max_cpu_loras)
            lora = served.spec
            for adapter, at in (adapters or {}).items():
                served.add(adapter, at, pinned=adapter in pinned_adapters)
        spec = DecoderSpec(pages.offset, pages.nbytes, pages.page_bytes, shape, max_sequences, int(context),
                           graph_mode, compiled, lora)
        # NOTE [Prefix caching]: this load's pages are keyed apart from any other's.
        tag = f"{name}#{os.getpid()}#{next(_loads)}#{id(pages)}".encode()
        batch = Batch(pages, spec, tag, caching=prefix_caching, eos=frozenset(eos),
                      adapters=served.slots if served is not None else None)
        engine = Engine(runtime, name, decode=decode, eos=eos, vocab=vocab, max_context=int(context),
                        max_sequences=max_sequences, batch=batch, quantum_s=quantum_s,
                        offload_kv=offload_kv, kv_budget=kv_budget, multi_step_s=multi_step_s,
                        lane_bytes=turn_lane_bytes(config, dtype, max_sequences, int(context), prefill_peak),
                        grammars=LLGuidance(tokenizer))
    except BaseException:
        if region is not None:
            runtime.unreserve(region)
        if served is not None:
            runtime.unreserve(adapter_region(name))
        runtime.unregister(name)
        raise
    if profile:  # resident and idle: NOTE [Decode graphs]
        engine.capture_now()
    return LanguageModel(runtime, name, path, tokenizer, config, engine, batch, region, served)


def adapter_region(model: str) -> str:
    """The owner of the region of the arena that holds ``model``'s adapter slots."""
    return f"lora-slots:{model}"


def adapter_slots(runtime: Runtime, model: str, config: Any, dtype: torch.dtype, slots: int, rank: int,
                  lora_dir: str | Path | None, max_host: int | None = None) -> Adapters:
    """``slots`` adapter slots of rank ``rank`` for ``model`` in a region of ``runtime``'s
    arena (NOTE [Adapters in slots]), and its adapters' table (at most ``max_host`` in
    host memory), none added yet."""
    if slots < 1 or rank < 1:
        raise ConfigError(f"model {model!r}: max_loras and max_lora_rank must be at least 1, got {slots} and {rank}")
    if lora_dir is not None and not Path(lora_dir).is_dir():
        raise ConfigError(f"model {model!r}: lora_dir {str(lora_dir)!r} is not a directory")
    spec = adapter_spec(config, slots, rank, dtype)
    region = runtime.reserve(adapter_region(model), spec.nbytes, what=f"adapter slots of {model!r}")
    try:
        spec = spec.at(region.offset, spec.nbytes)
        stacks = LoraStacks(spec, region.memory)
        for slot in range(1, spec.slots):
            stacks.clear(slot)  # whatever the arena held there
        return Adapters(model, spec, AdapterSlots(stacks), pin_host=runtime.device.type == "cuda",
                        resolve_dir=lora_dir, max_host=max_host)
    except BaseException:
        runtime.unreserve(adapter_region(model))
        raise


DEFAULT_POOL_BYTES = 2 << 30


def pool_bytes(shape: KVShape, max_sequences: int, max_context: int) -> tuple[int, int]:
    """Pages of 32 positions and the bytes of ``max_sequences`` rows at ``max_context``
    positions in them (at most ``DEFAULT_POOL_BYTES``)."""
    page_bytes = page_bytes_for(shape)
    block = min(page_bytes // shape.position_bytes, MAX_BLOCK)
    want = max_sequences * -(-(max_context + 1) // block) * page_bytes  # every row at full length
    return page_bytes, max(min(want, DEFAULT_POOL_BYTES), page_bytes)


def pool_need(path: str | Path, dtype: str | None, max_sequences: int, max_context: int | None) -> tuple[int, int]:
    """``pool_bytes`` of the model directory ``path`` (its config read, nothing else)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048
    shape = KVShape.of(config, parse_dtype(dtype) or torch.float32)
    return pool_bytes(shape, max_sequences, max_context or int(positions))


def own_pool_bytes(path: str | Path, dtype: str | None, max_sequences: int, max_context: int | None = None) -> int:
    """The bytes of the arena the page pool of its own that ``load`` makes for the model
    directory ``path`` takes (NOTE [Regions of the arena]): for sizing ``memory``."""
    page_bytes, nbytes = pool_need(path, dtype, max_sequences, max_context)
    return pool_footprint(nbytes, page_bytes)


def pool_region(model: str) -> str:
    """The owner of the region of the arena that holds ``model``'s own page pool."""
    return f"kv-pages:{model}"


def arena_pool(runtime: Runtime, owner: str, nbytes: int, page_bytes: int) -> PagePool:
    """A pool of ``nbytes`` in pages of ``page_bytes`` in a region of ``runtime``'s arena
    that ``owner`` holds until ``runtime.unreserve(owner)`` (NOTE [Regions of the arena]):
    planned with the models' weights, at addresses that never move while it lives."""
    region = runtime.reserve(owner, pool_footprint(nbytes, page_bytes), what=f"key/value pages ({owner})")
    return PagePool(region.memory, region.offset, page_bytes, owner)


def kv_bytes_per_token(config: Any, dtype: str | None) -> int:
    """The key/value cache bytes one position of one sequence takes, every layer."""
    return KVShape.of(config, dtype).position_bytes


def turn_lane_bytes(config: Any, dtype: str | None, max_sequences: int, max_context: int, prefill_peak: int) -> int:
    """What a turn's lane holds under 'pack' (NOTE [Turns in lanes]): the caches of
    ``max_sequences`` sequences at ``max_context`` positions, and the profiled prefill's
    peak scaled from ``PROFILE_TOKENS`` to ``max_context`` tokens, each with headroom."""
    caches = kv_bytes_per_token(config, dtype) * max_sequences * max_context
    return lane_bytes(caches) + lane_bytes(prefill_peak * max(1, max_context // PROFILE_TOKENS))


@dataclass(frozen=True)
class Directory:
    """What a Hugging Face model directory says before any weight is read."""

    path: Path
    config: Any
    tokenizer: Any
    max_context: int
    vocab: int
    eos: set[int]


def open_directory(name: str, path: str | Path, max_context: int | None = None) -> Directory:
    """Read ``path``'s config and tokenizer (clear errors for a directory that is not a
    model's); ``max_context`` at most the model's positions (default: all of them)."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{str(path)!r} is not a model directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise ConfigError(f"{path}/config.json cannot be read ({exc})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ConfigError(f"{path}: the tokenizer cannot be read ({exc})") from None
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    context = max_context or positions
    if not context:
        raise ConfigError(f"model {name!r}: its config gives no context length; set max_context")
    if positions and context > positions:
        raise ConfigError(f"model {name!r}: max_context {context} exceeds its {positions} positions")
    vocab = int(config.vocab_size)
    eos = _ids(getattr(config, "eos_token_id", None)) | _ids(tokenizer.eos_token_id)
    return Directory(path, config, tokenizer, int(context), vocab, eos)


def _ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}
