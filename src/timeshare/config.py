"""``timeshare.yaml``: the one file that describes a server: the runtime (device, memory
budget, workers, scheduling, eviction), the HTTP server (ports, limits), the admin plane
(who may use it), the models and the training jobs. Runs in the server's process.

Validated by pydantic at load time; every error names the field, as a path
("models[1].max_batch"), and the value it got. Unknown fields are errors, so a typo
never silently falls back to a default. ``timeshare serve --print-default-config``
shows every field with its default.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from timeshare.dtypes import DATATYPE_NAMES
from timeshare.errors import ConfigError
from timeshare.units import parse_bytes

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # safe in a URL path segment
_UNION_TAG = re.compile(r"^(int|str|float|bool|none|list\[.*\]|dict\[.*\]|function-\w+\[.*\]|literal\[.*\]"
                        r"|constrained-\w+)$")

# The Open Inference Protocol's tensor datatypes that models here can take or return.
DATATYPES = DATATYPE_NAMES


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def _name(value: str, what: str) -> str:
    if not _NAME.match(value):
        raise ValueError(f"{what} {value!r} must be 1-64 letters, digits, '_', '.' or '-', starting with a "
                         "letter or digit")
    return value


def _bytes_field(value: Any, what: str) -> int:
    try:
        return parse_bytes(value, what=what)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


class RuntimeConfig(_Strict):
    """How the device is shared (``timeshare.Runtime``'s arguments)."""

    device: str = "auto"
    """"auto", "cpu", "cuda" or "cuda:N"."""
    memory: int | str = "auto"
    """The device memory budget for model weights: bytes or "4GiB"; "auto" takes half the
    free device memory on CUDA and an eighth of RAM (at most 2 GiB) on the CPU."""
    workers: Annotated[int, Field(ge=0, le=64)] = 0
    """Worker processes (0: models run in the server's process). Training jobs with
    workers need at least 2."""
    scheduling: Literal["priority", "fifo", "fair", "srtf", "edf", "pack"] = "priority"
    """Who gets the device next; "priority" lets inference preempt training; "pack" runs
    the calls and training iterations of different memory lanes side by side (Salus's
    PACK)."""
    lane_memory: int | str = "auto"
    """With "pack": the bytes for lanes of ephemeral memory (activations) and training
    jobs' state, beside the arena; "auto": as much as the arena."""
    lane_threads: Annotated[int, Field(ge=1)] | None = None
    """With "pack" on the CPU: the cores each lane's forward uses (default: half of them)."""
    lane_slots: Annotated[int, Field(ge=1)] | None = None
    """With "pack": how many lanes run at once (default: one per worker with workers; on
    the CPU in the server's process, the cores over ``lane_threads``; on CUDA, as many as
    memory allows)."""
    time_slice_s: Annotated[float, Field(gt=0)] | None = None
    """With "fifo" or "fair": how long a training job keeps the device before waiting calls run."""
    eviction: Literal["lru", "clock", "second_chance", "working_set", "cost"] = "lru"
    """Which resident model leaves when a new one needs room (on the device, and in host
    memory under ``host_memory``)."""
    host_memory: int | str | None = None
    """A budget for the models' host copies: bytes, "8GiB" or "auto" (half the RAM). Under
    it host memory is a cache over disk: a model whose weights are a safetensors file is
    read from it only when a load needs it, and dropped again under pressure; others are
    written once to ``spill_dir``. Null (the default): every host copy stays in memory.
    With a budget every model needs example inputs (its layer order is traced at
    registration)."""
    direct_io: bool = False
    """Under ``host_memory``: read weights files with O_DIRECT where the file system
    allows, bypassing the page cache (buffered reads, dropped from the cache after each
    read, were the faster on the machines measured)."""
    spill_dir: str | None = None
    """Under ``host_memory``: where host copies with no weights file behind them go when
    dropped (default: a temporary folder, removed at shutdown)."""
    kv_memory: int | str | None = None
    """With ``llms``: how many bytes of the device the key/value caches of language models
    may keep there between their turns; beyond it, the caches of the models that ran least
    recently move to host memory until their next turn. Null: they all stay."""
    dedup: bool = False
    """Tensors of identical content across models (fine-tuned variants of one base model)
    are held once in host memory and once on the device, and a load copies only those not
    resident. Needs no host_memory for now."""
    thrashing: bool = False
    """Thrashing control: while loads take most of the device's time, the models used
    recently are kept resident and each model's requests wait longer to form batches."""
    strategy: Literal["optimal", "per_layer", "whole", "fixed"] = "optimal"
    """How loads are grouped."""
    task_timeout_s: Annotated[float, Field(gt=0)] | None = None
    """A worker that does not answer a task (or a training iteration) within this many
    seconds is killed and replaced. Default: the server's ``request_timeout_s``, so a hung
    worker costs at most one request deadline. Must exceed the slowest training iteration."""
    task_deadline_factor: Annotated[float, Field(ge=1)] = 10.0
    """Once a kind of call has been answered, its deadline is this many times its slowest
    recent call of the same kind (load or resident), at least ``task_deadline_min_s`` and
    at most ``task_timeout_s``: a hung worker is found in seconds, not a request timeout.
    Training iterations get the same rule."""
    task_deadline_min_s: Annotated[float, Field(gt=0)] = 5.0
    """The shortest deadline a call gets, whatever its history."""

    def runtime_kwargs(self, default_task_timeout_s: float) -> dict[str, Any]:
        """``timeshare.Runtime``'s keyword arguments for this section; a task's deadline
        defaults to ``default_task_timeout_s`` (the server's request timeout)."""
        return dict(device=self.device, memory=self.memory, eviction=self.eviction, strategy=self.strategy,
                    workers=self.workers, thrashing=self.thrashing, dedup=self.dedup, scheduling=self.scheduling,
                    time_slice_s=self.time_slice_s, lane_memory=self.lane_memory, lane_threads=self.lane_threads,
                    lane_slots=self.lane_slots, host_memory=self.host_memory, spill_dir=self.spill_dir,
                    direct_io=self.direct_io,
                    task_timeout_s=self.task_timeout_s or default_task_timeout_s,
                    task_deadline_factor=self.task_deadline_factor, task_deadline_min_s=self.task_deadline_min_s)

    @field_validator("memory", "lane_memory", "host_memory", "kv_memory", mode="before")
    @classmethod
    def _memory(cls, v, info):
        if (v == "auto" and info.field_name != "kv_memory") or (v is None and info.field_name in ("host_memory",
                                                                                                   "kv_memory")):
            return v
        _bytes_field(v, info.field_name)
        return v


class ServerConfig(_Strict):
    """The HTTP server: where it listens and what it accepts."""

    host: str = "0.0.0.0"
    """The data plane's address. The admin plane answers loopback clients only, unless a token is set."""
    http_port: Annotated[int, Field(ge=0, le=65535)] = 8000
    """Open Inference Protocol, admin and /metrics (0: any free port)."""
    metrics_port: Annotated[int, Field(ge=0, le=65535)] | None = 8002
    """A second port that serves only /metrics (null: none)."""
    max_request_bytes: int | str = "64MiB"
    """Larger request bodies get 413."""
    request_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """A request not answered by then gets 504; what it queued is dropped."""
    drain_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """On Ctrl-C or SIGTERM: how long in-flight requests may take to finish."""
    warmup: bool = True
    """Run every model once at start-up (this profiles it) before the server is ready."""
    openapi: bool = False
    """Serve the API's description (/openapi.json, /docs, /redoc). Off by default: it maps
    the admin plane for anyone who can reach the port."""
    header_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """A connection must send a request's line and headers within this many seconds of
    opening, or of its previous answer; else it is closed (with 408 if it had sent part of
    them). Idle keep-alive connections close sooner, after uvicorn's 5 s."""
    body_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """A request's whole body must arrive within this many seconds of its headers, or the
    request gets 408 and its connection is closed: a client cannot hold a connection by
    trickling. Raise it for clients that upload large bodies over slow links."""
    max_header_bytes: int | str = "16KiB"
    """A request line plus headers over this size gets 431 and its connection is closed."""
    max_connections: Annotated[int, Field(ge=1)] = 1000
    """Connections beyond this many open ones get 503 at once and are closed."""
    parse_in_process_bytes: int | str = "1MiB"
    """JSON request bodies up to this size are parsed on the event loop; larger ones in a
    parser process, so that parsing them (seconds for tens of MB) stalls no other client."""
    parse_processes: Annotated[int, Field(ge=0, le=64)] = 2
    """Parser processes for large bodies (0: parse every body on the event loop). Each
    parses one body at a time, with a peak memory of about 6 times the body's size."""
    parse_queue: Annotated[int, Field(ge=0)] = 4
    """Large bodies that may wait for a busy parser; beyond that they get 503 with Retry-After."""

    @field_validator("max_request_bytes", "parse_in_process_bytes", mode="before")
    @classmethod
    def _limit(cls, v, info):
        return _bytes_field(v, info.field_name)

    @field_validator("max_header_bytes", mode="before")
    @classmethod
    def _header_limit(cls, v):
        n = _bytes_field(v, "max_header_bytes")
        if n < 1024:
            raise ValueError("max_header_bytes must be at least 1 KiB")
        return n


class AdminConfig(_Strict):
    """The admin plane: the model repository (load, unload, index), pinning and training jobs."""

    enabled: bool = True
    token: str | None = None
    """When set, any client with "Authorization: Bearer <token>" may use the admin plane;
    without one, only loopback clients may."""
    token_env: str | None = "TIMESHARE_ADMIN_TOKEN"
    """An environment variable to read the token from when ``token`` is not set."""
    allowed_hosts: list[str] = []
    """Without a token, the admin plane accepts only requests whose Host (and Origin, when
    present) names localhost or a loopback address, so that a web page the operator visits
    cannot drive it (DNS rebinding, cross-site POSTs). Names added here are accepted too."""
    max_training_batch: Annotated[int, Field(ge=1)] = 256
    """Training jobs submitted through the admin plane (not those of this file) take at
    most this batch; a larger one gets 400."""
    max_training_iterations: Annotated[int, Field(ge=1)] | None = 1_000_000
    """Submitted training jobs must give ``iterations``, at most this many (null: no limit,
    and jobs that run until cancelled may be submitted)."""
    max_training_jobs: Annotated[int, Field(ge=1)] = 4
    """A submission while this many training jobs run (those of this file included) gets 409."""
    max_finished_jobs: Annotated[int, Field(ge=0)] = 32
    """Finished training jobs (done, failed or cancelled) kept for status queries; the
    oldest are forgotten first."""

    def resolved_token(self) -> str | None:
        if self.token:
            return self.token
        if self.token_env:
            return os.environ.get(self.token_env) or None
        return None


class ClusterConfig(_Strict):
    """Serve from a timeshare cluster on Ray (NOTE [Cluster deployment]): several
    replicas, each a runtime on its own device built from the ``runtime`` section, with
    every model registered on each and requests routed between them. The HTTP APIs are
    the same; ``/admin/status`` and ``/metrics`` add up the replicas."""

    address: str | None = None
    """A running Ray cluster ("host:port", "ray://host:port" or "auto"); null starts a
    local one on this host's loopback interface."""
    replicas: Annotated[int, Field(ge=1, le=1024)] = 2
    """Replicas started with the server."""
    max_replicas: Annotated[int, Field(ge=1, le=1024)] | None = None
    """Replicas may be added at run time (``POST /admin/replicas``) up to this many
    (default: two more than ``replicas``)."""
    policy: Literal["timeshare", "ray", "least-loaded", "random"] = "timeshare"
    """How a request's replica is chosen (NOTE [Fleet routing])."""
    num_cpus: Annotated[int, Field(ge=1)] | None = None
    """A local cluster's CPUs (each replica takes one; default: one per replica slot, plus one)."""
    call_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """A replica that does not answer a call within this many seconds beyond the wait
    the router expected is taken for dead and replaced by the others."""
    start_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    """How long a replica may take to start and warm every model up."""
    migrate_after_s: Annotated[float, Field(gt=0)] | None = 2.0
    """A training job preempted for this long, while another replica has no job and no
    requests in flight, moves there (SwitchFlow's migration; null: never on its own)."""
    cpu_fallback: int | str | None = None
    """Bytes for a CPU runtime beside each replica's device, with every model registered
    there too: a request runs on the replica's CPU when that would end sooner than waiting
    for its busy device (NOTE [CPU fallback]). Null: none. Meant for GPU replicas; on CPU
    replicas both runtimes share the same cores."""
    seed: int = 0
    """The router's random numbers (the "random" policy, ties)."""

    @field_validator("cpu_fallback", mode="before")
    @classmethod
    def _fallback_bytes(cls, v):
        if v is not None:
            _bytes_field(v, "cpu_fallback")
        return v

    @model_validator(mode="after")
    def _bounds(self):
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be at least replicas ({self.replicas})")
        return self


class TensorSpec(_Strict):
    """One input of a model, as the Open Inference Protocol describes it."""

    name: str
    datatype: Literal[DATATYPES]  # type: ignore[valid-type]
    shape: list[Annotated[int, Field(ge=-1)]]
    """-1 marks a dimension of any size; the first is the batch dimension."""
    min: int | None = None
    """The smallest value an integer input may hold (token ids: 0)."""
    max: int | None = None
    """The largest value an integer input may hold (token ids: the vocabulary size - 1)."""

    @model_validator(mode="after")
    def _bounds(self):
        if (self.min is not None or self.max is not None) and self.datatype not in (
                "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"):
            raise ValueError(f"input {self.name!r}: min and max apply to integer datatypes only, not {self.datatype}")
        return self


class ModelConfig(_Strict):
    """A model to serve: from the zoo (``zoo``) or from code (``build``)."""

    name: str
    zoo: str | None = None
    """A zoo model's name (``timeshare models`` lists them); its inputs and seeded weights come with it."""
    build: str | None = None
    """"module:function" returning an nn.Module (needs ``inputs``)."""
    weights: str | None = None
    """A safetensors file (default: the zoo's seeded weights; the module's own values for ``build``)."""
    inputs: list[TensorSpec] | None = None
    """The forward's positional inputs, in order (default for the zoo: from its example inputs)."""
    example_batch: Annotated[int, Field(ge=1)] = 1
    """The batch of the example inputs used to profile the model."""
    dtype: Literal["fp32", "fp16", "bf16"] | None = None
    pinned: bool = False
    """Load at start-up and never evict; the server is not ready until it is resident."""
    priority: Literal["latency_critical", "best_effort"] = "latency_critical"
    slo_ms: Annotated[float, Field(gt=0)] | None = None
    """A latency objective; the deadline (from the request's arrival) that orders calls of one
    priority under "priority" and "edf"."""
    max_batch: Annotated[int, Field(ge=1, le=4096)] = 8
    """At most this many rows per request, and per batch formed from concurrent requests."""
    max_queue: Annotated[int, Field(ge=1)] = 64
    """Requests waiting for this model beyond this get 503 with Retry-After."""
    batching: bool = True
    """Run concurrent requests as one forward along dimension 0 (false: when an output's
    first dimension is not the batch, e.g. a summary over the batch)."""

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v):
        return _name(v, "model name")

    @model_validator(mode="after")
    def _source(self):
        if (self.zoo is None) == (self.build is None):
            raise ValueError("give exactly one of 'zoo' (a zoo model) or 'build' ('module:function')")
        if self.zoo is not None:
            from timeshare.models.zoo import ZOO

            if self.zoo not in ZOO:
                raise ValueError(f"unknown zoo model {self.zoo!r}; known: {sorted(ZOO)}")
        elif not self.inputs:
            raise ValueError("a model given by 'build' needs 'inputs' (name, datatype and shape of each)")
        if self.inputs is not None:
            names = [i.name for i in self.inputs]
            if len(set(names)) != len(names):
                raise ValueError(f"input names must be distinct, got {names}")
            for i in self.inputs:
                if not i.shape:
                    raise ValueError(f"input {i.name!r} needs a batch dimension (shape [-1, ...])")
        if self.weights is not None and not Path(self.weights).is_file():
            raise ValueError(f"weights file {self.weights!r} does not exist")
        return self


class TrainingConfig(_Strict):
    """A training job on a zoo model with a synthetic objective (seeded data)."""

    name: str
    model: str
    """A zoo model's name."""
    batch: Annotated[int, Field(ge=1)] = 8
    iterations: Annotated[int, Field(ge=1)] | None = None
    """Stop after this many (null: run until cancelled)."""
    lr: Annotated[float, Field(gt=0)] = 1e-4
    offload: bool = False
    """Move the job's state to host memory while inference has the device."""
    seed: int = 0
    start: bool = True
    """Start with the server (false: submit it later through the admin plane)."""

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v):
        return _name(v, "training job name")

    @field_validator("model")
    @classmethod
    def _zoo_model(cls, v):
        from timeshare.models.zoo import ZOO

        if v not in ZOO:
            raise ValueError(f"unknown zoo model {v!r}; known: {sorted(ZOO)}")
        return v


class LLMConfig(_Strict):
    """A generative language model, served through the OpenAI-compatible API (``/v1``)."""

    name: str
    """The ``model`` field of requests."""
    path: str
    """A Hugging Face model directory: config.json, safetensors weights (sharded or not),
    tokenizer files and, for chat, a chat template."""
    dtype: Literal["fp32", "fp16", "bf16"] | None = None
    pinned: bool = False
    """Load at start-up and never evict."""
    priority: Literal["latency_critical", "best_effort"] = "latency_critical"
    max_context: Annotated[int, Field(ge=2)] | None = None
    """The longest prompt plus completion, in tokens (default: the model's positions)."""
    max_sequences: Annotated[int, Field(ge=1, le=1024)] = 8
    """Sequences decoded together; more wait their turn."""
    offload_kv: bool = False
    """While another task has the device, keep the key/value caches of this model's
    running generations in host memory (page-locked on CUDA) rather than on the device;
    they come back, unchanged, at its next turn."""
    quantum_ms: Annotated[float, Field(gt=0)] = 50.0
    """How long the model keeps the device while others of its priority wait (a more
    urgent request takes it at the next token)."""

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v):
        return _name(v, "language model name")

    @field_validator("path")
    @classmethod
    def _directory(cls, v):
        if not (Path(v) / "config.json").is_file():
            raise ValueError(f"{v!r} is not a model directory (no config.json)")
        return v


class Config(_Strict):
    """The whole of ``timeshare.yaml``."""

    runtime: RuntimeConfig = RuntimeConfig()
    server: ServerConfig = ServerConfig()
    admin: AdminConfig = AdminConfig()
    models: list[ModelConfig] = []
    llms: list[LLMConfig] = []
    training: list[TrainingConfig] = []
    cluster: ClusterConfig | None = None
    """Null: one runtime in the server's process (the usual case)."""

    @model_validator(mode="after")
    def _consistent(self):
        names = [m.name for m in self.models] + [m.name for m in self.llms]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"model names must be distinct; repeated: {dup}")
        if self.cluster is not None:
            if any(m.pinned for m in self.llms):
                raise ValueError("cluster: language models cannot be pinned on a cluster")
            pinned = [m.name for m in self.models if m.pinned]
            if pinned:
                raise ValueError(f"cluster: models cannot be pinned on a cluster (the router places them); "
                                 f"pinned: {pinned}")
            if self.runtime.device not in ("cpu", "cuda") or self.runtime.memory == "auto":
                raise ValueError("cluster: give runtime.device ('cpu', or 'cuda': each replica's own GPU) and "
                                 "runtime.memory (each replica's budget), not 'auto'")
        jobs = [t.name for t in self.training]
        dup = sorted({n for n in jobs if jobs.count(n) > 1})
        if dup:
            raise ValueError(f"training job names must be distinct; repeated: {dup}")
        if self.training and self.runtime.workers == 1:
            raise ValueError("runtime.workers: training with workers needs at least 2 (or 0 for in-process)")
        return self


def parse_config(data: Any, source: str = "config") -> Config:
    """Validate a parsed YAML document; a :class:`ConfigError` names every bad field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections "
                          f"(runtime, server, admin, models, llms, training, cluster), got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: " + "; ".join(_describe(e) for e in exc.errors())) from None


def load_config(path: str | os.PathLike) -> Config:
    """Read and validate ``timeshare.yaml``."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {str(p)!r}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    return parse_config(data, str(p))


def _describe(error: ErrorDetails) -> str:
    path = ""
    for part in error["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _UNION_TAG.match(str(part)):
            continue  # pydantic's label of a union's branch, not one of the user's fields
        else:
            path += f".{part}" if path else str(part)
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown field"
    if error["type"] == "missing":
        return f"{path}: required field missing"
    got = error.get("input")
    shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
    return f"{path or 'config'}: {msg}{shown}"


DEFAULT_CONFIG = Path(__file__).with_name("default.yaml")
"""The embedded default: the zoo models and a training job (``timeshare demo``)."""
