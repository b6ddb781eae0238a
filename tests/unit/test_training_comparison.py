"""``bench lanes``' comparison of jobs trained together with the same job alone: alone
twice first, so that a difference the kernels make is not taken for one packing makes."""

import math

import torch

from timeshare.bench.lanes import compare_training, weights_difference


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(4, 3, generator=g), "fc.bias": torch.randn(4, generator=g),
            "bn.num_batches_tracked": torch.tensor(20)}


def last_bit(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights, one float's last bit flipped: what another order of additions gives."""
    out = {k: v.clone() for k, v in state.items()}
    bits = out["fc.weight"].view(torch.int32)
    bits[1, 2] ^= 1
    return out


def test_equal_runs_are_exact():
    r = compare_training(weights(), weights(), [weights(), weights()])
    assert r["alone_repeatable"] and r["equals_alone"] and r["verdict"].startswith("exact")
    assert r["alone_max_abs_diff"] == 0.0 and r["max_abs_diff"] == 0.0


def test_alone_not_repeating_makes_the_comparison_inconclusive_even_when_together_matches():
    r = compare_training(weights(), last_bit(weights()), [weights(), weights()])
    assert not r["alone_repeatable"] and r["equals_alone"] and r["verdict"].startswith("inconclusive")
    assert 0.0 < r["alone_max_abs_diff"] < 1e-6  # a rounding difference, of the order of the last bit


def test_a_job_that_differs_from_a_repeatable_alone_is_flagged():
    off = weights()
    off["fc.bias"] = off["fc.bias"] + 0.5  # an update lost or mixed up: far beyond rounding
    r = compare_training(weights(), weights(), [weights(), off])
    assert r["alone_repeatable"] and not r["equals_alone"] and r["verdict"].startswith("SHARING CHANGES")
    assert math.isclose(r["max_abs_diff"], 0.5, rel_tol=1e-6)
    counted = weights()
    counted["bn.num_batches_tracked"] = torch.tensor(19)  # an integer buffer counts too
    assert compare_training(weights(), weights(), [counted])["max_abs_diff"] == 1.0


def test_differences_that_do_not_subtract():
    nan = weights()
    nan["fc.weight"][0, 0] = float("nan")
    assert weights_difference(weights(), nan) == math.inf
    assert weights_difference(nan, nan) == math.inf  # as outputs_equal: a NaN equals nothing
    reshaped = weights()
    reshaped["fc.bias"] = reshaped["fc.bias"][:3]
    assert weights_difference(weights(), reshaped) is None
    assert weights_difference(weights(), {k: v for k, v in weights().items() if k != "fc.bias"}) is None
    r = compare_training(weights(), weights(), [reshaped])
    assert not r["equals_alone"] and r["max_abs_diff"] is None
    assert not compare_training(weights(), weights(), [])["equals_alone"]  # nothing together: nothing shown
