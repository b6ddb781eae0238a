"""Issue 34, item 2: ``timeshare serve --check``'s checker (``server/check.py``) on good and
broken models, and how a failure to load is classified (``server/status.py``)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from timeshare.config import ModelConfig, TensorSpec, parse_config
from timeshare.errors import (
    ConfigError,
    LoadFailed,
    ModelError,
    ModelTooLargeError,
    Overloaded,
    RemoteError,
    Unavailable,
    WeightsError,
    WorkerCrashedError,
)
from timeshare.models.weights import read_weights
from timeshare.models.zoo import weights_path
from timeshare.server.check import check_config, check_model
from timeshare.server.status import FailureKind, failure_of, retry_headers

LINEAR = [TensorSpec(name="x", datatype="FP32", shape=[-1, 4])]  # tests.failing_models:linear's input
LINEAR_INPUTS = [s.model_dump(exclude_none=True) for s in LINEAR]  # the same, as YAML gives it


def linear(tmp_path, name: str = "lin", **tensors) -> ModelConfig:
    """A model built by ``tests.failing_models:linear`` (weight 2x4, bias 2) with a weights
    file holding ``tensors`` (default: the right shapes)."""
    tensors = tensors or {"weight": torch.ones(2, 4), "bias": torch.zeros(2)}
    path = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(path))
    return ModelConfig(name=name, build="tests.failing_models:linear", weights=str(path), inputs=LINEAR)


def test_good_models_pass_and_say_what_was_checked(tmp_path):
    zoo = check_model(ModelConfig(name="mlp", zoo="tiny_mlp"))
    assert zoo.ok and zoo.problem is None, zoo
    assert str(weights_path("tiny_mlp")) in zoo.detail and "tensors" in zoo.detail
    built = check_model(linear(tmp_path))
    assert built.ok, built
    assert built.detail.startswith("2 tensors,") and "lin.safetensors" in built.detail
    own = check_model(ModelConfig(name="own", build="tests.failing_models:linear", inputs=LINEAR))
    assert own.ok and "the module's own values" in own.detail


def test_a_builder_that_cannot_be_imported_is_named():
    c = check_model(ModelConfig(name="gone", build="no_such_module_for_check:make", inputs=LINEAR))
    assert not c.ok and c.name == "gone" and c.kind == "model"
    assert c.problem is not None and c.problem.startswith("ConfigError: cannot import 'no_such_module_for_check'")
    missing = check_model(ModelConfig(name="nofn", build="tests.failing_models:nothing", inputs=LINEAR))
    assert missing.problem == "ConfigError: build 'tests.failing_models:nothing': 'tests.failing_models' has no " \
                              "callable 'nothing'"


def test_a_builder_that_raises_or_returns_no_module_fails():
    raising = check_model(ModelConfig(name="r", build="tests.failing_models:raising", inputs=LINEAR))
    assert raising.problem is not None and raising.problem.startswith("ModelError: building model 'r' failed")
    assert "broken on purpose" in raising.problem
    odd = check_model(ModelConfig(name="s", build="tests.failing_models:not_a_module", inputs=LINEAR))
    assert odd.problem == "ModelError: build for model 's' returned str, not a torch.nn.Module"


def test_corrupt_weights_are_found_from_the_header(tmp_path):
    garbled = tmp_path / "garbled.safetensors"
    garbled.write_bytes(b"\x0e\x00\x00\x00\x00\x00\x00\x00{not a header}")
    c = check_model(ModelConfig(name="g", zoo="tiny_mlp", weights=str(garbled)))
    assert c.problem is not None and c.problem.startswith(f"WeightsError: weights file {str(garbled)!r} has a header "
                                                          "that is not JSON")
    truncated = tmp_path / "truncated.safetensors"
    whole = weights_path("tiny_mlp").read_bytes()
    truncated.write_bytes(whole[: len(whole) // 2])  # the header intact, the data cut short
    c = check_model(ModelConfig(name="t", zoo="tiny_mlp", weights=str(truncated)))
    assert c.problem is not None and c.problem.startswith(f"WeightsError: weights file {str(truncated)!r}: tensor ")
    assert f"or the file ({len(whole) // 2} bytes)" in c.problem
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    c = check_model(ModelConfig(name="s", zoo="tiny_mlp", weights=str(short)))
    assert c.problem == f"WeightsError: weights file {str(short)!r} is too short for a safetensors header"


def test_weights_that_do_not_match_the_module_name_the_tensor(tmp_path):
    c = check_model(linear(tmp_path, "shape", weight=torch.ones(3, 4), bias=torch.zeros(2)))
    assert c.problem == "WeightsError: tensor 'weight' has shape [3, 4] in the weights but [2, 4] in the module"
    c = check_model(linear(tmp_path, "missing", weight=torch.ones(2, 4)))
    assert c.problem == "WeightsError: weights have no tensor 'bias' (parameter, shape [2])"
    c = check_model(linear(tmp_path, "extra", weight=torch.ones(2, 4), bias=torch.zeros(2), other=torch.zeros(1)))
    assert c.problem == "WeightsError: weights have tensor 'other' that the module does not have"
    c = check_model(linear(tmp_path, "dtype", weight=torch.ones(2, 4, dtype=torch.int32), bias=torch.zeros(2)))
    assert c.problem == "WeightsError: tensor 'weight' has dtype torch.int32 in the weights but torch.float32 in " \
                        "the module"
    state = read_weights(str(weights_path("tiny_mlp")))  # a zoo model's file with one tensor reshaped
    name = sorted(state)[0]
    state[name] = torch.zeros(state[name].shape[0] + 1, *state[name].shape[1:])
    save_file(state, str(tmp_path / "zoo.safetensors"))
    c = check_model(ModelConfig(name="z", zoo="tiny_mlp", weights=str(tmp_path / "zoo.safetensors")))
    assert c.problem is not None and c.problem.startswith(f"WeightsError: tensor {name!r} has shape ")


def test_a_model_larger_than_the_budget_fails(tmp_path):
    cfg = linear(tmp_path)
    assert check_model(cfg, budget=1 << 20).ok
    c = check_model(cfg, budget=1000)  # two tensors of 512-byte alignment: 1024 bytes
    assert c.problem == "ModelTooLargeError: model 'lin' needs 1,024 bytes of device memory but the whole arena " \
                        "holds only 1,000 bytes; raise Runtime(memory=...)"


def test_the_report_names_each_failure_and_leaves_optional_ones_out(tmp_path):
    good = linear(tmp_path, "good")
    config = parse_config({"runtime": {"memory": "1MiB"}, "models": [
        good.model_dump(exclude_none=True),
        {"name": "gone", "build": "no_such_module_for_check:make", "inputs": LINEAR_INPUTS},
        {"name": "maybe", "build": "tests.failing_models:raising", "inputs": LINEAR_INPUTS, "optional": True},
    ]})
    report = check_config(config)
    assert [c.name for c in report.checks] == ["good", "gone", "maybe"]
    assert [c.ok for c in report.checks] == [True, False, False]
    assert [c.name for c in report.failed] == ["gone"] and not report.ok
    tight = parse_config({"runtime": {"memory": 1000}, "models": [good.model_dump(exclude_none=True)]})
    assert (check_config(tight).failed[0].problem or "").startswith("ModelTooLargeError")


@pytest.mark.parametrize("exc, kind", [
    (ConfigError("cannot import 'x'"), FailureKind.PERMANENT),
    (ModelError("building model 'm' failed"), FailureKind.PERMANENT),
    (WeightsError("weights file 'w' is corrupt"), FailureKind.PERMANENT),
    (ModelTooLargeError("m", 10, 5), FailureKind.PERMANENT),
    (RuntimeError("the forward raised"), FailureKind.PERMANENT),
    (RemoteError("ValueError: bad", remote_type="builtins.ValueError", in_task=True), FailureKind.PERMANENT),
    (RemoteError("OOM", remote_type="torch.OutOfMemoryError", in_task=True), FailureKind.TRANSIENT),
    (RemoteError("a bug of ours", remote_type="builtins.KeyError", in_task=False), FailureKind.TRANSIENT),
    (MemoryError("out of memory"), FailureKind.TRANSIENT),
    (WorkerCrashedError("worker 1 was killed by signal 9"), FailureKind.TRANSIENT),
    (Overloaded("full", 3), FailureKind.TRANSIENT),
])
def test_failures_to_load_are_permanent_or_transient(exc, kind):
    failure = failure_of(exc)
    assert failure.kind is kind and failure.permanent is (kind is FailureKind.PERMANENT)
    assert failure.cause == f"{type(exc).__name__}: {exc}"
    assert failure.describe() == f"{kind.value}: {failure.cause}"


def test_only_a_permanent_failure_goes_without_retry_after():
    assert retry_headers(LoadFailed("model 'm' failed to load"), 503) is None
    assert retry_headers(Unavailable("model 'm' is loading"), 503) == {"Retry-After": "1"}
    assert retry_headers(Overloaded("full", 7), 503) == {"Retry-After": "7"}
    assert retry_headers(ConfigError("bad"), 400) is None
