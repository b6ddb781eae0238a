"""Reading weights and checking them against a module. Runs where models are registered.

Weights come from a safetensors file or an in-memory state dict. Every mismatch is a
:class:`~timeshare.errors.WeightsError` that names the tensor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from timeshare.errors import WeightsError
from timeshare.models.binding import TensorLayout
from timeshare.transfer.disk import SafetensorsIndex

WeightsSource = str | os.PathLike | Sequence[str | os.PathLike] | Mapping[str, torch.Tensor]


def is_file_source(source: object) -> bool:
    """Whether ``weights`` names safetensors files (one, or a model's shards)."""
    return isinstance(source, (str, os.PathLike)) or (
        isinstance(source, (list, tuple)) and bool(source) and all(isinstance(p, (str, os.PathLike)) for p in source))


def read_weights(source: WeightsSource | object) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file or of a model's shards (a list of files), by
    name, or a copy of a state dict's mapping. Anything else (a user's ``weights`` as
    given) raises :class:`WeightsError`."""
    if isinstance(source, Mapping):
        bad = [k for k, v in source.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise WeightsError(f"state dict entry {bad[0]!r} is not a tensor")
        return dict(source)
    if isinstance(source, (list, tuple)) and is_file_source(source):
        merged: dict[str, torch.Tensor] = {}
        for shard in source:
            part = read_weights(shard)
            twice = sorted(merged.keys() & part.keys())
            if twice:
                raise WeightsError(f"tensor {twice[0]!r} is in two shards (again in {str(shard)!r})")
            merged.update(part)
        return merged
    if not isinstance(source, (str, os.PathLike)):
        raise WeightsError("weights must be a safetensors path, a list of shards or a state dict, got "
                           f"{type(source).__name__}")
    path = Path(source)
    if not path.exists():
        raise WeightsError(f"weights file {str(path)!r} does not exist")
    if path.suffix != ".safetensors":
        raise WeightsError(f"weights file {str(path)!r} is not a .safetensors file")
    try:
        out = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
        return out
    except Exception as exc:  # safetensors raises several types for damaged files
        raise WeightsError(f"weights file {str(path)!r} is corrupt or unreadable: {exc}") from exc


def apply_weights(layout: TensorLayout, current: dict[str, torch.Tensor],
                  state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Match ``state`` (by name) to the layout's tensors; return new tensors by key.

    Tied tensors may appear under any of their names. Non-persistent buffers keep the
    module's own value when absent. Floating tensors are converted to the module's
    dtype; any other dtype mismatch, a missing tensor, a shape mismatch or an
    unexpected name is an error naming the tensor.
    """
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for e in layout.entries:
        present = [n for n in e.names if n in state]
        if not present:
            if not layout.persistent[e.key]:
                out[e.key] = current[e.key]
                continue
            raise WeightsError(f"weights have no tensor {e.names[0]!r} ({e.kind}, shape {list(e.shape)})")
        name = present[0]
        used.update(present)
        t = state[name]
        for other in present[1:]:
            if not torch.equal(state[other], t):
                raise WeightsError(f"tied tensors {name!r} and {other!r} have different values in the weights")
        if tuple(t.shape) != e.shape:
            raise WeightsError(
                f"tensor {name!r} has shape {list(t.shape)} in the weights but {list(e.shape)} in the module"
            )
        if t.dtype != e.dtype:
            if not (t.dtype.is_floating_point and e.dtype.is_floating_point):
                raise WeightsError(f"tensor {name!r} has dtype {t.dtype} in the weights but {e.dtype} in the module")
            t = t.to(e.dtype)
        out[e.key] = t
    unexpected = sorted(set(state) - used)
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise WeightsError(f"weights have tensor {unexpected[0]!r}{more} that the module does not have")
    return out


def match_file(layout: TensorLayout, index: SafetensorsIndex,
               current: dict[str, torch.Tensor]) -> tuple[dict[str, str], dict[str, torch.Tensor], dict]:
    """``apply_weights`` from a file's header alone (NOTE [Host tier]): for each of the
    layout's tensors, the file's tensor to read it from, or the module's own value when
    the file has none (a non-persistent buffer). The same errors as ``apply_weights``
    except for the values of tied tensors, which are compared when the file is read.
    Returns ``(sources, kept, tied)``: key -> file name, key -> tensor kept in memory,
    key -> the other file names of a tied tensor."""
    sources: dict[str, str] = {}
    kept: dict[str, torch.Tensor] = {}
    tied: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    for e in layout.entries:
        present = [n for n in e.names if n in index.tensors]
        if not present:
            if not layout.persistent[e.key]:
                kept[e.key] = current[e.key].detach().clone()
                continue
            raise WeightsError(f"weights have no tensor {e.names[0]!r} ({e.kind}, shape {list(e.shape)})")
        name = present[0]
        used.update(present)
        ft = index.tensors[name]
        if ft.shape != e.shape:
            raise WeightsError(
                f"tensor {name!r} has shape {list(ft.shape)} in the weights but {list(e.shape)} in the module"
            )
        if ft.dtype != e.dtype and not (ft.dtype.is_floating_point and e.dtype.is_floating_point):
            raise WeightsError(f"tensor {name!r} has dtype {ft.dtype} in the weights but {e.dtype} in the module")
        sources[e.key] = name
        if len(present) > 1:
            tied[e.key] = tuple(present[1:])
    unexpected = sorted(set(index.tensors) - used)
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise WeightsError(f"weights have tensor {unexpected[0]!r}{more} that the module does not have")
    return sources, kept, tied


def save_weights(module: torch.nn.Module, path: str | os.PathLike) -> Path:
    """Write ``module``'s state dict as safetensors, atomically, one copy per tied tensor."""
    from timeshare.models.binding import collect

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    layout = collect(module)
    tensors = layout.tensors()
    state = {
        e.names[0]: tensors[e.key].detach().contiguous().cpu()
        for e in layout.entries
        if layout.persistent[e.key]
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(state, str(tmp))
    os.replace(tmp, path)
    return path


def load_strictly(module: torch.nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """``module.load_state_dict(state)`` that refuses any mismatch: a key of the module the
    weights do not give is an error (a module built on meta and given storage with
    ``to_empty`` would otherwise compute with uninitialised memory), except a tied tensor,
    which a weights file names once; an unexpected key is an error too."""
    result = module.load_state_dict(state, strict=False)
    own = module.state_dict(keep_vars=True)
    loaded = {own[k].data_ptr() for k in state if k in own}
    untied = [k for k in result.missing_keys if own[k].data_ptr() not in loaded or own[k].device.type == "meta"]
    if untied or result.unexpected_keys:
        raise WeightsError(f"{what}: the weights do not match the module (missing {untied[:5]}, "
                           f"unexpected {result.unexpected_keys[:5]})")
