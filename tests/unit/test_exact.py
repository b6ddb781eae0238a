"""The exactness check every other test relies on (tests/exact.py): each respect in which
two results can differ fails it, on its own, and what it leaves to its callers passes."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch

from tests.exact import nan_free, same

Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Box:
    logits: torch.Tensor
    note: str = "kept"


X = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
NAN = torch.tensor([float("nan")])


def _result(x: torch.Tensor) -> dict:
    return {"t": (x, [x.sum(), Pair(x > 0, 3)]), "box": Box(x.double()), "n": None}


def test_equal_results_are_the_same_in_every_container():
    assert same(_result(X), _result(X.clone()))
    assert same(X.t(), X.t().contiguous())  # values in order, whatever the layout
    assert same(torch.empty(0, 3), torch.empty(0, 3)) and same(torch.tensor(3.5), torch.tensor(3.5))
    assert same(NAN, NAN.clone())  # the channel round-trips NaN: the same bits are the same value
    c = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    assert same(c.conj(), c.conj().resolve_conj())


@pytest.mark.parametrize("a, b", [
    (X, X.view(torch.int32)),  # the same bytes read as another dtype
    (X, X.reshape(3, 2)),  # the same bytes in another shape
    (X, X.double()),
    (torch.tensor([0.0]), torch.tensor([-0.0])),  # equal as numbers, not bit for bit
    (NAN, NAN.view(torch.int32).add(1).view(torch.float32)),  # another NaN payload
    (X, X + 1e-7 * X.abs().max()),
    ((X,), [X]),
    (Pair(X, 1), (X, 1)),
    ({"a": X}, {"b": X}),
    ((X, X), (X,)),
    (Box(X), Box(X, "changed")),
    (X, X.tolist()),
    (None, X),
], ids=["dtype", "shape", "precision", "signed-zero", "nan-payload", "value", "container", "named-tuple",
        "keys", "length", "dataclass-field", "tensor-or-list", "none"])
def test_each_difference_alone_makes_two_results_differ(a, b):
    assert not same(a, b) and not same(b, a)


def test_what_the_callers_check_themselves_is_left_out():
    assert same(X, X.t().contiguous().t())  # strides
    assert same(X, X.clone().requires_grad_())  # requires_grad
    assert same(X, torch.nn.Parameter(X.clone()))  # a tensor subclass


def test_nan_free_finds_a_nan_anywhere_in_a_result():
    assert nan_free(_result(X)) and nan_free([torch.tensor([1, 2]), torch.tensor([True])])
    assert not nan_free({"t": (X, [Box(torch.cat([X.flatten(), NAN]))])})
