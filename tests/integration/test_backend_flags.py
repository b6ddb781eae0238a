"""Worker processes compute with the numerics flags of the process that created the runtime."""

from dataclasses import fields

import pytest
import torch

import timeshare
from tests import models
from timeshare.device import BackendFlags


@pytest.fixture
def unusual_flags():
    """Flags unlike the ones found, given back afterwards (also when setting them fails)."""
    before = BackendFlags.capture()
    try:
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
    finally:
        before.apply()
    assert BackendFlags.capture() == before


def test_apply_sets_every_captured_flag_back(unusual_flags):
    # Every flag changed since the capture (one precision is enough for that field) ...
    m = torch.backends.cuda.matmul
    torch.backends.cudnn.benchmark = not unusual_flags.cudnn_benchmark
    torch.backends.cudnn.deterministic = not unusual_flags.cudnn_deterministic
    m.allow_fp16_reduced_precision_reduction = not unusual_flags.matmul_allow_fp16_reduced
    m.allow_bf16_reduced_precision_reduction = not unusual_flags.matmul_allow_bf16_reduced
    torch.use_deterministic_algorithms(not unusual_flags.deterministic_algorithms,
                                       warn_only=not unusual_flags.deterministic_warn_only)
    if unusual_flags.legacy is None:
        m.fp32_precision = "ieee"  # "tf32" in unusual_flags
    else:
        torch.set_float32_matmul_precision("highest")  # "medium" in unusual_flags
    changed = BackendFlags.capture()
    unused = "legacy" if unusual_flags.legacy is None else "precisions"  # one of the two APIs is captured
    differ = [f.name for f in fields(BackendFlags) if getattr(changed, f.name) != getattr(unusual_flags, f.name)]
    assert differ == [f.name for f in fields(BackendFlags) if f.name != unused], differ
    # ... and apply() puts each one back.
    unusual_flags.apply()
    assert BackendFlags.capture() == unusual_flags


def test_workers_run_with_the_creators_backend_flags(unusual_flags):
    x = (torch.randn(2, 4),)
    with timeshare.Runtime(device="cpu", memory="4MiB", workers=1, profile_repeats=1) as rt:
        rt.register("probe", "tests.models:flags_probe", None, x)
        in_worker = rt.infer("probe", *x)
    local = models.flags_probe()(*x)
    assert torch.equal(in_worker, local), (in_worker, local)
