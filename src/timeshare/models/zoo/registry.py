"""The zoo's index: how to build each model, its example inputs, its expected size,
and its seeded weights, generated once and cached as safetensors.

The cache directory is ``$TIMESHARE_CACHE`` or ``~/.cache/timeshare``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from timeshare.errors import ConfigError
from timeshare.models.weights import save_weights
from timeshare.seeding import seeded

log = logging.getLogger(__name__)

WEIGHTS_VERSION = 1  # bump when a builder changes, so stale caches are not reused


@dataclass(frozen=True)
class ZooModel:
    name: str
    builder: str  # "module:function", importable in any process
    parameters: int  # expected parameter count (asserted by the tests)
    make_inputs: Callable[[int, torch.dtype, int], tuple]
    small: bool
    description: str
    input_names: tuple[str, ...] = ("x",)  # the forward's positional arguments
    input_bounds: tuple[tuple[int, int] | None, ...] = ()  # valid [min, max] of integer inputs (token ids)

    def build(self) -> nn.Module:
        from timeshare.models.spec import resolve_builder

        return resolve_builder(self.builder)()

    def example_inputs(self, batch: int = 1, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple:
        return self.make_inputs(batch, dtype, seed)


def _images(size: int) -> Callable[[int, torch.dtype, int], tuple]:
    def make(batch: int, dtype: torch.dtype, seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, 3, size, size, generator=g).to(dtype),)

    return make


def _tokens(vocab: int, length: int) -> Callable[[int, torch.dtype, int], tuple]:
    def make(batch: int, dtype: torch.dtype, seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[:, length - length // 8 :] = 0  # some padding, so the mask matters
        return (ids, mask)

    return make


def _vectors(width: int) -> Callable[[int, torch.dtype, int], tuple]:
    def make(batch: int, dtype: torch.dtype, seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, width, generator=g).to(dtype),)

    return make


def _ids(vocab: int, length: int) -> Callable[[int, torch.dtype, int], tuple]:
    def make(batch: int, dtype: torch.dtype, seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab, (batch, length), generator=g),)

    return make


_P = "timeshare.models.zoo"
ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in [
        ZooModel("resnet152", f"{_P}.resnet:resnet152", 60_192_808, _images(224), False, "ResNet-152, 224x224 images"),
        ZooModel("inception_v3", f"{_P}.inception:inception_v3", 27_161_264, _images(299), False,
                 "Inception-v3 with auxiliary head, 299x299 images"),
        ZooModel("bert_base", f"{_P}.bert:bert_base", 109_482_240, _tokens(30522, 128), False,
                 "BERT-base encoder + pooler, 128 tokens", ("input_ids", "attention_mask"), ((0, 30521), (0, 1))),
        ZooModel("small_resnet", f"{_P}.resnet:small_resnet", 557_684, _images(64), True,
                 "ResNet of one bottleneck per stage, quarter width, 64x64 images (bench lanes)"),
        ZooModel("tiny_mlp", f"{_P}.small:tiny_mlp", 6_922, _vectors(32), True, "3-layer MLP"),
        ZooModel("tiny_cnn", f"{_P}.small:tiny_cnn", 2_970, _images(16), True, "2 convs with BatchNorm"),
        ZooModel("tiny_bert", f"{_P}.bert:tiny_bert", 139_456, _tokens(1000, 16), True, "2-layer BERT",
                 ("input_ids", "attention_mask"), ((0, 999), (0, 1))),
        ZooModel("tied_lm", f"{_P}.small:tied_lm", 5_312, _ids(100, 12), True, "tied embeddings, reused block",
                 ("ids",), ((0, 99),)),
    ]
}


def names(small: bool | None = None) -> list[str]:
    return [n for n, m in ZOO.items() if small is None or m.small == small]


def get(name: str) -> ZooModel:
    try:
        return ZOO[name]
    except KeyError:
        raise ConfigError(f"unknown zoo model {name!r}; known: {sorted(ZOO)}") from None


def cache_dir() -> Path:
    return Path(os.environ.get("TIMESHARE_CACHE") or Path.home() / ".cache" / "timeshare")


def weights_path(name: str, seed: int = 0, directory: str | os.PathLike | None = None) -> Path:
    """The seeded weights of zoo model ``name``, generated on first use."""
    model = get(name)
    root = Path(directory) if directory is not None else cache_dir()
    path = root / "weights" / f"{name}-seed{seed}-v{WEIGHTS_VERSION}.safetensors"
    if path.exists():
        return path
    log.info("generating weights for %s (seed %d) in %s", name, seed, path)
    with seeded(seed):  # NOTE [One random state per process]
        module = model.build()
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        _calibrate_batchnorm(module, model.example_inputs(4, torch.float32, seed + 1))
    return save_weights(module, path)


@torch.no_grad()
def _calibrate_batchnorm(module: nn.Module, inputs: tuple) -> None:
    """Give BatchNorm layers running statistics of real activations, so generated
    weights behave like trained ones (no exploding or vanishing activations)."""
    bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over the calibration batch
    module.train()
    module(*inputs)
    for bn in bns:
        bn.momentum = 0.1
    module.eval()
