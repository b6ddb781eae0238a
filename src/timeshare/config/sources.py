"""What ``timeshare serve MODEL ...`` names, made into config sections: a Hugging Face
model directory, a repository id found in the local Hugging Face cache (read offline, in
the cache's own layout: nothing is downloaded), or a safetensors file with a builder.
A causal language model becomes an ``llms`` entry (the OpenAI-compatible API); an encoder
or a classifier, or a weights file with ``--build``, a ``models`` entry (the Open Inference
Protocol; an encoder also answers ``/v1/embeddings``). Runs in the CLI's
process, before the server starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from timeshare.config.workloads import LLMConfig, ModelConfig, TensorSpec
from timeshare.errors import ConfigError

# The heads of causal language models in transformers' class names.
_CAUSAL = ("ForCausalLM", "LMHeadModel")


@dataclass(frozen=True)
class Found:
    """Where a MODEL argument led: its directory (or file) and the name it is served as."""

    path: Path
    name: str
    repo_id: str | None = None  # found in the Hugging Face cache under this id


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache this process would read: ``HF_HUB_CACHE``, else
    ``HF_HOME``/hub, else ``~/.cache/huggingface/hub`` (huggingface_hub's own order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def from_cache(repo_id: str, cache: Path | None = None) -> Path | None:
    """The snapshot directory of ``repo_id`` in the local cache (its ``main`` revision),
    None if the cache does not hold it. Offline: huggingface_hub reads the cache's layout
    and never asks the network."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ConfigError(f"{repo_id!r}: reading the Hugging Face cache needs huggingface_hub "
                          "(pip install 'timeshare[llm]'), or give the model's directory") from None

    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache or hf_cache_dir()), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None  # ValueError: not a valid repository id


def find(arg: str, cache: Path | None = None) -> Found:
    """A MODEL argument's directory or file: the path if it exists, else the repository
    id in the Hugging Face cache; a ConfigError saying where it looked otherwise."""
    path = Path(arg).expanduser()
    if path.exists():
        resolved = path.resolve()
        return Found(resolved, resolved.stem if resolved.is_file() else resolved.name)
    if arg.count("/") <= 1 and not arg.startswith((".", "/", "~")):
        snapshot = from_cache(arg, cache)
        if snapshot is not None:
            return Found(snapshot, arg, repo_id=arg)
    raise ConfigError(f"{arg!r} is neither a file, a directory nor a repository in the Hugging Face cache "
                      f"({cache or hf_cache_dir()}; nothing is downloaded: fetch it first, e.g. "
                      f"`huggingface-cli download {arg}`)")


def architecture(directory: Path) -> str:
    """The model class a Hugging Face directory's config.json names (``architectures``)."""
    config = directory / "config.json"
    try:
        data = json.loads(config.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{directory} is not a Hugging Face model directory (no config.json)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{config} cannot be read: {exc}") from None
    names = data.get("architectures") or []
    if not names or not isinstance(names[0], str):
        raise ConfigError(f"{config} names no architecture (its 'architectures' field); cannot tell how to "
                          "serve it")
    return names[0]


def tensor_spec(text: str) -> TensorSpec:
    """``--input NAME:DATATYPE:SHAPE`` ("x:FP32:-1,3,32,32"; -1: any size) as a spec."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ConfigError(f"--input {text!r}: give NAME:DATATYPE:SHAPE, e.g. x:FP32:-1,3,32,32")
    name, datatype, shape = parts
    try:
        dims = [int(d) for d in shape.split(",")]
        return TensorSpec(name=name, datatype=datatype.upper(), shape=dims)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"--input {text!r}: {str(exc).splitlines()[-1].strip() if exc.args else exc}") from None


def section(arg: str, *, name: str | None = None, build: str | None = None, inputs: list[TensorSpec] | None = None,
            cache: Path | None = None) -> LLMConfig | ModelConfig:
    """The config section that serves MODEL argument ``arg`` as ``name`` (default: the
    directory's or file's name, or the repository id); ``build`` and ``inputs``: a
    weights file's builder and its inputs."""
    found = find(arg, cache)
    served = name or found.name
    if found.path.is_file():
        if build is None:
            raise ConfigError(f"{arg}: a weights file needs --build module:function (the code that builds its "
                              "module); a Hugging Face directory needs nothing")
        if not inputs:
            raise ConfigError(f"{arg}: a weights file needs its inputs: --input NAME:DATATYPE:SHAPE for each")
        return ModelConfig(name=served, build=build, weights=str(found.path), inputs=inputs)
    if build is not None:
        raise ConfigError(f"{arg}: --build applies to a weights file, not to a model directory")
    arch = architecture(found.path)
    if arch.endswith(_CAUSAL):
        return LLMConfig(name=served, path=str(found.path))
    # An encoder or a classifier: the Open Inference Protocol, whose routes name it in the
    # URL path, so a repository id's '/' becomes '--'.
    return ModelConfig(name=name or served.replace("/", "--"), path=str(found.path))
