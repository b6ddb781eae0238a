"""The ``models``, ``llms`` and ``training`` sections of ``timeshare.yaml``: what a server
runs (models from the zoo or from code with their inputs, generative language models,
training jobs), each checked against the zoo or the files it names. Runs in the server's
process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from timeshare.config.fields import DATATYPES, Strict, valid_name
from timeshare.options import DEFAULT_MAX_LORAS


class TensorSpec(Strict):
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


class ModelConfig(Strict):
    """A model to serve: from the zoo (``zoo``), from code (``build``) or from a Hugging Face
    directory (``path``)."""

    name: str
    zoo: str | None = None
    """A zoo model's name (``timeshare models`` lists them); its inputs and seeded weights come with it."""
    build: str | None = None
    """"module:function" returning an nn.Module (needs ``inputs``)."""
    path: str | None = None
    """A Hugging Face directory of an encoder or a classifier (its config.json names a
    transformers class, e.g. BertModel): built from its config, its weights from its
    safetensors shards; inputs ``input_ids`` and ``attention_mask`` (INT64, [-1, -1])
    unless given. An encoder also answers ``/v1/embeddings``."""
    weights: str | None = None
    """A safetensors file (default: the zoo's seeded weights; the module's own values for ``build``)."""
    inputs: list[TensorSpec] | None = None
    """The forward's positional inputs, in order (default for the zoo: from its example inputs)."""
    example_batch: Annotated[int, Field(ge=1)] = 1
    """The batch of the example inputs used to profile the model."""
    dtype: Literal["fp32", "fp16", "bf16"] | None = None
    pinned: bool = False
    """Load at start-up and never evict; the server is not ready until it is resident."""
    optional: bool = False
    """The server may be ready without it: readiness (``/v2/health/ready``) waits for every
    other model, and ``server.exit_on_error`` ignores its failure; it still loads and serves
    when it can."""
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
        return valid_name(v, "model name")

    @model_validator(mode="before")
    @classmethod
    def _directory_inputs(cls, data):
        """A directory's model takes token ids and a mask, bounded by its vocabulary."""
        if isinstance(data, dict) and data.get("path") is not None and data.get("inputs") is None:
            vocab = _vocabulary(Path(data["path"]))
            data = {**data, "inputs": [
                {"name": "input_ids", "datatype": "INT64", "shape": [-1, -1], "min": 0, "max": vocab - 1},
                {"name": "attention_mask", "datatype": "INT64", "shape": [-1, -1], "min": 1, "max": 1}]}
        return data

    @model_validator(mode="after")
    def _source(self):
        if sum(x is not None for x in (self.zoo, self.build, self.path)) != 1:
            raise ValueError("give exactly one of 'zoo' (a zoo model), 'build' ('module:function') or 'path' (a "
                             "Hugging Face directory)")
        if self.path is not None and self.weights is not None:
            raise ValueError("a model given by 'path' takes its weights from the directory: no 'weights'")
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


class TrainingConfig(Strict):
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
        return valid_name(v, "training job name")

    @field_validator("model")
    @classmethod
    def _zoo_model(cls, v):
        from timeshare.models.zoo import ZOO

        if v not in ZOO:
            raise ValueError(f"unknown zoo model {v!r}; known: {sorted(ZOO)}")
        return v


class AdapterConfig(Strict):
    """A LoRA adapter of a language model (NOTE [Adapter residency])."""

    name: str
    """The ``model`` field of its requests."""
    path: str
    """A directory in PEFT's format: adapter_config.json and adapter_model.safetensors."""
    pinned: bool = False
    """Once on the device, never evicted from its slot."""

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v):
        valid_name(v, "adapter name")
        return v

    @field_validator("path")
    @classmethod
    def _adapter_directory(cls, v):
        if not (Path(v) / "adapter_config.json").is_file():
            raise ValueError(f"{v!r} is not an adapter directory (no adapter_config.json)")
        return v


class LLMConfig(Strict):
    """A generative language model, served through the OpenAI-compatible API (``/v1``)."""

    name: str
    """The ``model`` field of requests."""
    path: str
    """A Hugging Face model directory: config.json, safetensors weights (sharded or not),
    tokenizer files and, for chat, a chat template."""
    dtype: Literal["fp32", "fp16", "bf16"] | None = None
    pinned: bool = False
    """Load at start-up and never evict."""
    optional: bool = False
    """The server may be ready without it (see the models' ``optional``)."""
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
    decode_graphs: bool = True
    """On CUDA: decode steps replay CUDA graphs captured when the model is resident and
    idle, in-process and in the worker its steps run in (false: every step eager, as
    vLLM's ``enforce_eager``)."""
    compile: bool = True
    """On CUDA, the step the decode graphs capture is compiled by inductor first (at
    registration: seconds to minutes, once per model shape, kept in inductor's cache on
    disk); false: transformers' eager step is captured."""
    multi_step_ms: Annotated[float, Field(ge=0, le=1000)] = 20.0
    """While no request waits to be admitted, one runtime call runs as many decode steps
    as take this long (at most 16; NOTE [Multi-step decode]): a small model's fixed cost
    per step is paid once a burst, and tokens reach streams a burst at a time. 0: one step
    a call."""
    prefix_caching: bool = True
    """Share the key/value pages of prompt prefixes computed before (a system prompt, a
    conversation resent each turn) between requests, and keep them after their requests
    end while the pages are not needed, as vLLM's automatic prefix caching."""

    adapters: list[AdapterConfig] = Field(default_factory=list)
    """LoRA adapters of this model, each in PEFT's format, served by their names
    (NOTE [Adapter residency]); more can be loaded at run time (``POST
    /v1/load_lora_adapter``) or found by ``lora_dir``."""
    max_loras: Annotated[int, Field(ge=1, le=1024)] | None = None
    """Adapters on the device at once (default 8 when it serves adapters); more take
    turns in their slots, least recently used out first."""
    max_lora_rank: Annotated[int, Field(ge=1, le=1024)] = 64
    """The largest rank of an adapter it serves (each slot holds this rank for every
    projection)."""
    lora_dir: str | None = None
    """A directory of adapter directories: a request naming an adapter not loaded yet
    loads ``lora_dir/NAME`` (vLLM's resolver)."""
    max_cpu_loras: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    """Adapters in host memory at most (at least ``max_loras``; default: no bound): the
    least recently requested one not on the device lets its copy go, and is read from its
    directory again on its next request (vLLM's ``--max-cpu-loras``)."""

    @field_validator("adapters")
    @classmethod
    def _distinct(cls, v):
        names = [a.name for a in v]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names must differ, got {names}")
        return v

    @model_validator(mode="after")
    def _host_bound(self):
        slots = self.max_loras or DEFAULT_MAX_LORAS
        if self.max_cpu_loras is not None and self.max_cpu_loras < slots:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({slots})")
        return self

    @field_validator("lora_dir")
    @classmethod
    def _lora_directory(cls, v):
        if v is not None and not Path(v).is_dir():
            raise ValueError(f"lora_dir {v!r} is not a directory")
        return v

    @property
    def decode_modes(self) -> tuple[str, str]:
        """``graphs`` and ``compile`` as ``llm.model.load`` takes them."""
        return "auto" if self.decode_graphs else "off", "auto" if self.compile else "off"

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v):
        # As a Hugging Face repository id ("org/model"): requests name it in their body only.
        parts = v.split("/")
        if len(parts) > 2:
            raise ValueError(f"language model name {v!r} may hold one '/' at most (as 'org/model')")
        for part in parts:
            valid_name(part, "language model name")
        return v

    @field_validator("path")
    @classmethod
    def _directory(cls, v):
        if not (Path(v) / "config.json").is_file():
            raise ValueError(f"{v!r} is not a model directory (no config.json)")
        return v


def _vocabulary(directory: Path) -> int:
    """The vocabulary size a Hugging Face directory's config.json gives."""
    import json

    try:
        vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{directory} is not a Hugging Face model directory with a vocab_size ({exc})") from None
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"{directory}/config.json: vocab_size must be a positive integer, got {vocab!r}")
    return vocab
