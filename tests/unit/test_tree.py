"""The walks over nested inputs and outputs (NOTE [Walks on the fast path]): every kind of
container is opened and rebuilt as its own type, leaves are left alone."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import NamedTuple

import torch

from timeshare.tree import map_instances, map_tensors, shape_key, tensors_in


class Pair(NamedTuple):
    a: object
    b: object


@dataclasses.dataclass
class Box:
    t: object
    label: str = "x"


class MyList(list):
    pass


class MyTensor(torch.Tensor):
    pass


def _structure():
    x, y, z = torch.ones(2), torch.zeros(3), torch.full((1,), 7.0)
    return (x, [y, {"k": z, "s": "text", "n": None}], Pair(x, 3), Box(y), OrderedDict(a=z), MyList([x]), 4, 2.5,
            True, b"raw", ())


def test_every_container_is_rebuilt_as_its_type_with_each_tensor_mapped():
    out = map_tensors(_structure(), lambda t: t + 1)
    assert type(out) is tuple and len(out) == 11
    assert torch.equal(out[0], torch.full((2,), 2.0))
    assert type(out[1]) is list and torch.equal(out[1][0], torch.ones(3))
    assert out[1][1]["s"] == "text" and out[1][1]["n"] is None and torch.equal(out[1][1]["k"], torch.full((1,), 8.0))
    assert type(out[2]) is Pair and out[2].b == 3 and torch.equal(out[2].a, torch.full((2,), 2.0))
    assert type(out[3]) is Box and out[3].label == "x" and torch.equal(out[3].t, torch.ones(3))
    assert type(out[4]) is OrderedDict and torch.equal(out[4]["a"], torch.full((1,), 8.0))
    assert type(out[5]) is MyList and torch.equal(out[5][0], torch.full((2,), 2.0))
    assert out[6:] == (4, 2.5, True, b"raw", ())


def test_tensor_subclasses_and_parameters_are_tensors_to_the_walk():
    p = torch.nn.Parameter(torch.ones(2))
    sub = torch.ones(2).as_subclass(MyTensor)
    seen = tensors_in({"p": p, "s": [sub]})
    assert len(seen) == 2 and seen[0] is p and seen[1] is sub


def test_empty_containers_come_back_empty_and_new():
    d: dict = {}
    out = map_tensors(d, lambda t: t)
    assert out == {} and out is not d
    assert map_tensors([], lambda t: t) == [] and map_tensors((), lambda t: t) == ()


def test_map_instances_replaces_instances_in_the_same_structures():
    @dataclasses.dataclass(frozen=True)
    class Ref:
        n: int

    obj = (Ref(1), [Ref(2), {"r": Ref(3), "i": 4}], Pair(Ref(5), "s"), Box(Ref(6)), OrderedDict(r=Ref(7)))
    out = map_instances(obj, Ref, lambda r: r.n * 10)
    assert out == (10, [20, {"r": 30, "i": 4}], Pair(50, "s"), Box(60), OrderedDict(r=70))
    assert type(out[2]) is Pair and type(out[4]) is OrderedDict


def test_map_instances_of_a_leaf_type_and_its_subclasses():
    assert map_instances((1, True, "a", 2.0), int, lambda i: -1) == (-1, -1, "a", 2.0)  # bool is an int
    assert map_instances((1, True), bool, lambda b: "yes") == (1, "yes")


def test_shape_key_describes_every_tensor_in_order():
    x = torch.ones(2, 3)
    assert shape_key((x,), {}) == "0:(2, 3):float32"
    assert shape_key(([x, x.half()],), {"m": {"k": torch.ones(1, dtype=torch.int64)}}) == \
        "0:(2, 3):float32,0:(2, 3):float16,m:(1,):int64"
    assert shape_key((), {}) == "()"
