"""Worker processes compute with the numerics flags of the process that created the runtime."""

import os
from contextlib import nullcontext
from dataclasses import fields

import pytest
import torch

import timeshare
from tests import models
from timeshare.device import BackendFlags, deterministic_kernels


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
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8" if before.cublas_workspace_config != ":16:8" else ":4096:8"
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
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG")
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


def test_workers_compute_with_deterministic_kernels_when_their_creator_does():
    """NOTE [Deterministic kernels]: a runtime created inside ``deterministic_kernels`` has
    workers that compute (and train) with deterministic algorithms, cuDNN deterministic
    without benchmark, and CUBLAS_WORKSPACE_CONFIG set; one created outside has none of it."""
    x = (torch.randn(2, 4),)
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    asked = []
    for deterministic in (True, False):
        with deterministic_kernels() if deterministic else nullcontext():
            with timeshare.Runtime(device="cpu", memory="4MiB", workers=1, profile_repeats=1) as rt:
                rt.register("probe", "tests.models:determinism_probe", None, x)
                asked.append(rt.infer("probe", *x).tolist())
    on, off = asked
    assert on == [1.0, 1.0, 0.0, 1.0], on  # deterministic algorithms, cuDNN deterministic, no benchmark, cuBLAS
    assert off[0] == 0.0 and off[3] == float(env in (":4096:8", ":16:8")), off
    assert not torch.are_deterministic_algorithms_enabled() and os.environ.get("CUBLAS_WORKSPACE_CONFIG") == env
