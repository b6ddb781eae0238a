"""What "the same result" means in every test that checks exactness: one comparison,
one strictness, for outputs in-process, from workers, through the tensor channel and on
CUDA alike; beside it, the check that an expected result computed by a runtime needs, and
the plain module's outputs that a runtime's are held to. Runs in the test process."""

from __future__ import annotations

import dataclasses

import torch
from safetensors.torch import load_file

from timeshare.models.zoo import ZOO
from timeshare.tree import tensors_in


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in order as bytes on the CPU (NaN payloads and -0.0 included)."""
    flat = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def same(a: object, b: object) -> bool:
    """Whether ``a`` and ``b`` are the same result, bit for bit.

    Checked, all the way down: the same structure, that is ``a`` and ``b`` of the same type,
    tuples and lists (named tuples too) of the same length, dicts (transformers' outputs too)
    with the same keys, dataclasses field by field; every tensor, against a tensor (a
    ``Parameter`` counts as one), of the same dtype and shape and with the same bytes,
    read on the CPU: a NaN equals a NaN of the same bits (the tensor channel round-trips
    them), and -0.0 differs from 0.0; any other value by ``==``.

    Not checked: devices, strides, ``requires_grad``; a test that relies on one asserts it
    itself. A NaN in both results passes: where the expected result was computed by a
    runtime rather than by the plain module, assert :func:`nan_free` on it too."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b)))
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return bool(a == b)


def nan_free(result: object) -> bool:
    """Whether no tensor in ``result`` holds a NaN: what an expected result computed by a
    runtime must show before it stands for the right answer. A NaN there may be poison read
    too early (NOTE [Poisoned reloads]) or stale device memory, which the same fault would
    put, bit for bit, into the result compared with it, and :func:`same` would pass both."""
    return not any(bool(torch.isnan(t).any()) for t in tensors_in(result))


def plain_outputs(build, weights, *args, **kwargs):
    """What the runtime must give bit for bit: the plain module's outputs, built by
    ``build`` (a zoo name or a function), its ``weights`` file loaded the ordinary way
    (or none), in eval mode, on the CPU, in this process."""
    module = build() if callable(build) else ZOO[build].build()
    if weights is not None:
        module.load_state_dict(load_file(str(weights)), strict=False)
    module.eval()
    with torch.no_grad():
        return module(*args, **kwargs)
