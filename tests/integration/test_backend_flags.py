"""Worker processes compute with the numerics flags of the process that created the runtime."""

import pytest
import torch

import timeshare
from tests import models
from timeshare.device import BackendFlags


@pytest.fixture
def unusual_flags():
    before = BackendFlags.capture()
    torch.backends.cudnn.benchmark = not before.cudnn_benchmark
    torch.backends.cudnn.deterministic = not before.cudnn_deterministic
    if hasattr(torch.backends.cudnn, "fp32_precision"):  # the newer API; mixing it with the legacy one is an error
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    else:
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("medium")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not before.matmul_allow_bf16_reduced
    wanted = BackendFlags.capture()
    assert wanted != before
    yield wanted
    before.apply()
    assert BackendFlags.capture() == before


def test_capture_and_apply_round_trip(unusual_flags):
    BackendFlags.capture().apply()
    assert BackendFlags.capture() == unusual_flags


def test_workers_run_with_the_creators_backend_flags(unusual_flags):
    x = (torch.randn(2, 4),)
    with timeshare.Runtime(device="cpu", memory="4MiB", workers=1, profile_repeats=1) as rt:
        rt.register("probe", "tests.models:flags_probe", None, x)
        in_worker = rt.infer("probe", *x)
    local = models.flags_probe()(*x)
    assert torch.equal(in_worker, local), (in_worker, local)
