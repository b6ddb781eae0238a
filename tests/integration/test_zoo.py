"""The full-size zoo: architectures match the papers' parameter counts, and a
pipelined first inference returns exactly the resident model's outputs."""

import pytest
import torch
from safetensors import safe_open

import timeshare
from tests.exact import same
from timeshare.models.zoo import ZOO, names, weights_path
from timeshare.tree import tensors_in

BIG = names(small=False)


@pytest.mark.parametrize("name", names())
def test_parameter_counts(name):
    module = ZOO[name].build()
    assert sum(p.numel() for p in module.parameters()) == ZOO[name].parameters


def test_reference_counts_are_the_published_ones():
    assert ZOO["resnet152"].parameters == 60_192_808
    assert ZOO["inception_v3"].parameters == 27_161_264
    assert ZOO["bert_base"].parameters == 109_482_240
    no_aux = ZOO["inception_v3"].build()
    no_aux.aux = None
    assert sum(p.numel() for p in no_aux.parameters()) == 23_834_568


def test_weights_are_seeded_and_cached(tmp_path):
    a = weights_path("tiny_cnn", seed=3, directory=tmp_path)
    mtime = a.stat().st_mtime_ns
    assert weights_path("tiny_cnn", seed=3, directory=tmp_path).stat().st_mtime_ns == mtime  # not regenerated
    b = weights_path("tiny_cnn", seed=4, directory=tmp_path)
    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        assert not torch.equal(fa.get_tensor("conv1.weight"), fb.get_tensor("conv1.weight"))
        # calibrated BatchNorm statistics, not the defaults
        assert not torch.equal(fa.get_tensor("bn1.running_var"), torch.ones(16))
    a.unlink()
    again = weights_path("tiny_cnn", seed=3, directory=tmp_path)
    with safe_open(str(again), "pt") as fa, safe_open(str(b), "pt") as fb:
        assert not torch.equal(fa.get_tensor("conv1.weight"), fb.get_tensor("conv1.weight"))


@pytest.mark.parametrize("name", BIG)
def test_pipelined_first_inference_is_bitwise_exact(name):
    zoo = ZOO[name]
    x = zoo.example_inputs(1)
    with timeshare.Runtime(device="cpu", memory="1GiB", profile_repeats=1, poison_evicted=True) as rt:
        rt.register(name, zoo.builder, weights_path(name), x)
        first = rt.infer(name, *x)
        ready = rt.infer(name, *x)
        prof = rt.profile(name)
        assert len(prof.layer_bytes) > 50
        if name == "inception_v3":  # the auxiliary head is never used by an inference
            assert prof.tail_bytes > 13_000_000
        for strategy in ("optimal", "per_layer"):
            rt.evict(name)
            assert same(rt.call(name, x, strategy=strategy).output, ready), strategy
        assert same(first, ready)
        assert tensors_in(ready) and all(torch.isfinite(t).all() for t in tensors_in(ready))
