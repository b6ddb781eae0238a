"""Unit tests of the serving side's pure parts: timeshare.yaml validation, Open Inference
Protocol tensors (JSON and binary) and the Endpoint (input checks, batching, outputs)."""

from __future__ import annotations

import asyncio
import math
from collections import namedtuple
from dataclasses import make_dataclass

import pytest
import torch

from timeshare.config import DEFAULT_CONFIG, ModelConfig, TensorSpec, load_config, parse_config
from timeshare.dtypes import TORCH_DTYPES
from timeshare.errors import BadRequest, ConfigError
from timeshare.server.endpoint import Endpoint, OutputSpec, Pending, describe_outputs, flatten_outputs, split_outputs
from timeshare.server.tensors import from_binary, from_json, to_binary, to_json_data

ZOO_MODELS = ["resnet152", "inception_v3", "bert_base", "tiny_mlp", "tiny_cnn", "tiny_bert", "tied_lm"]


# ---------------------------------------------------------------------------------- config
def test_default_config_and_defaults():
    cfg = load_config(DEFAULT_CONFIG)
    assert [m.zoo for m in cfg.models] == ["resnet152", "inception_v3", "bert_base"]
    assert [t.model for t in cfg.training] == ["tiny_cnn"] and cfg.runtime.memory == "600MiB"
    cfg = parse_config({})
    assert type(cfg.server.max_request_bytes) is int and cfg.server.max_request_bytes == 64 << 20
    assert cfg.models == [] and cfg.training == [] and cfg.server.http_port == 8000
    assert parse_config({"server": {"max_request_bytes": "1KiB"}}).server.max_request_bytes == 1024
    assert parse_config({"runtime": {"memory": "4GiB"}}).runtime.memory == "4GiB"


def _model(**kw) -> dict:
    return {"models": [{"name": "a", **kw}]}


def _build(**spec) -> dict:
    return _model(build="m:f", inputs=[{"name": "x", "datatype": "FP32", "shape": [-1], **spec}])


_JOB = {"name": "t", "model": "tiny_mlp"}


@pytest.mark.parametrize("data,expected", [
    ({"bogus": 1}, "bogus: unknown field"),
    ({"runtime": {"memroy": "1GiB"}}, "runtime.memroy: unknown field"),
    (_model(zoo="tiny_mlp", colour=1), "models[0].colour: unknown field"),
    ({"server": {"http_port": "abc"}}, "server.http_port: Input should be a valid integer"),
    ({"server": {"http_port": 70000}}, "server.http_port: Input should be less than or equal to 65535"),
    ({"server": {"metrics_port": -1}}, "server.metrics_port:"), ({"server": {"warmup": "maybe"}}, "server.warmup:"),
    ({"server": {"request_timeout_s": 0}}, "server.request_timeout_s:"),
    ({"server": {"max_request_bytes": 0}}, "server.max_request_bytes: max_request_bytes must be positive"),
    ({"runtime": {"workers": 65}}, "runtime.workers:"), ({"runtime": {"scheduling": "rr"}}, "runtime.scheduling:"),
    ({"runtime": {"memory": "4 potatoes"}}, "runtime.memory: memory '4 potatoes' is not a size"),
    ({"runtime": []}, "runtime: Input should be a valid dictionary"),
    ({"models": [{"name": "a", "zoo": "tiny_mlp"}, {"name": "b", "zoo": "tiny_mlp", "max_batch": 0}]},
     "models[1].max_batch: Input should be greater than or equal to 1 (got 0)"),
    ({"models": [{"zoo": "tiny_mlp"}]}, "models[0].name: required field missing"),
    ({"models": [{"name": "a/b", "zoo": "tiny_mlp"}]}, "models[0].name: model name 'a/b' must be"),
    (_model(zoo="tiny_mlp", build="m:f"), "models[0]: give exactly one of 'zoo'"),
    (_model(), "models[0]: give exactly one of 'zoo'"),
    (_model(build="m:f"), "models[0]: a model given by 'build' needs 'inputs'"),
    (_build(datatype="FP33"), "models[0].inputs[0].datatype:"),
    (_build(shape=[]), "models[0]: input 'x' needs a batch dimension"),
    (_model(zoo="tiny_mlp", weights="/no/such.safetensors"), "models[0]: weights file '/no/such.safetensors' does not"),
    ({"models": [{"name": "a", "zoo": "tiny_mlp"}, {"name": "a", "zoo": "tied_lm"}]},
     "model names must be distinct; repeated: ['a']"),
    ({"training": [_JOB, _JOB | {"model": "tiny_cnn"}]}, "training job names must be distinct; repeated: ['t']"),
    ({"training": [_JOB], "runtime": {"workers": 1}}, "runtime.workers: training with workers needs at least 2"),
    ({"training": [_JOB | {"model": "gpt5"}]}, "training[0].model: unknown zoo model 'gpt5'"),
])
def test_parse_config_errors_name_the_field(data, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(data, "my.yaml")
    assert str(info.value).startswith("my.yaml: ") and expected in str(info.value)


def test_unknown_zoo_model_lists_known_ones():
    with pytest.raises(ConfigError, match=r"models\[0\]: unknown zoo model 'nope'; known: \[") as info:
        parse_config(_model(zoo="nope"))
    assert all(repr(name) in str(info.value) for name in ZOO_MODELS)


def test_valid_neighbours_of_the_errors(tmp_path):
    for workers in (0, 2):
        assert parse_config({"training": [_JOB], "runtime": {"workers": workers}}).training[0].name == "t"
    (tmp_path / "w.safetensors").write_bytes(b"x")
    assert parse_config(_model(zoo="tiny_mlp", weights=str(tmp_path / "w.safetensors"))).models[0].weights
    assert parse_config(_build(min=0, max=3, datatype="INT64")).models[0].inputs[0].max == 3
    with pytest.raises(ConfigError, match=r"models\[0\]\.inputs\[0\]: input 'x': min and max apply to integer"):
        parse_config(_build(min=0, max=3))  # FP32


SIZE_FIELDS = pytest.mark.parametrize("section,field", [("server", "max_request_bytes"), ("runtime", "memory")])


@SIZE_FIELDS
def test_union_size_fields_report_a_plain_path(section, field):
    # int | str fields: pydantic's branch labels ("int", "str") must not leak into the path.
    with pytest.raises(ConfigError) as info:
        parse_config({section: {field: [1]}})
    assert f"{section}.{field}:" in str(info.value) and f"{field}.int" not in str(info.value)


@SIZE_FIELDS
def test_boolean_size_is_refused(section, field):
    # parse_bytes refuses booleans; YAML's `true` must not become a 1-byte size.
    with pytest.raises(ConfigError, match=rf"{section}\.{field}"):
        parse_config({section: {field: True}})


@pytest.mark.parametrize("text,pattern", [
    ("runtime:\n  device: cpu\n  workers: 0\n bad: [1, 2\n", r"c\.yaml: not valid YAML at line 4, column 2"),
    ("- runtime\n- server\n", r"c\.yaml: the top level must be a mapping.*got list"),
    ("models:\n  - name: m\n    zoo: tiny_mlp\n    max_batch: 5000\n", r"c\.yaml: models\[0\]\.max_batch: .*5000"),
    (None, r"cannot read config .*c\.yaml"),
])
def test_load_config_errors(tmp_path, text, pattern):
    if text is not None:
        (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=pattern):
        load_config(tmp_path / "c.yaml")


def test_load_config_files(tmp_path):
    (tmp_path / "ok.yaml").write_text("server:\n  max_request_bytes: 1KiB\nmodels:\n  - name: m\n    zoo: tiny_mlp\n")
    cfg = load_config(tmp_path / "ok.yaml")
    assert cfg.server.max_request_bytes == 1024 and cfg.models[0].name == "m"
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml") == parse_config({})


# ---------------------------------------------------------------------------------- tensors
@pytest.mark.parametrize("datatype,nested", [
    ("FP32", [[0.5, -1.25, 3.0], [4.0, 5.5, 1e-3]]), ("FP16", [[0.5, -1.0, 2], [65504.0, 0, 1]]),
    ("BF16", [[1.1, 2.2, -3.3], [1e30, 0.0, 7]]), ("INT64", [[-(2**63), 2**63 - 1, 0], [1, 2, 3]]),
    ("UINT8", [[0, 255, 3], [4, 5, 6]]), ("BOOL", [[True, False, True], [False, False, True]]),
])
def test_from_json_flat_and_nested(datatype, nested):
    expected = torch.tensor(nested, dtype=TORCH_DTYPES[datatype])
    flat = [v for row in nested for v in row]
    for data in (flat, nested):
        t = from_json("x", datatype, [2, 3], data)
        assert t.dtype == TORCH_DTYPES[datatype] and t.shape == (2, 3)
        assert torch.equal(t, expected)
    assert from_json("x", datatype, [0, 3], []).shape == (0, 3)


@pytest.mark.parametrize("data", [[2**63], [2**64 - 1], [5, 2**64 - 1]])
def test_from_json_large_uint64(data):
    # valid UINT64 values above the INT64 range
    assert from_json("x", "UINT64", [len(data)], data).tolist() == data


@pytest.mark.parametrize("datatype,shape,data,fragment", [
    ("FP32", [2, 2], [[1, 2], [3]], "ragged"), ("FP32", [2], ["1", "2"], "must be numbers, got strings"),
    ("INT64", [2], ["1", "2"], "must be integers, got strings"), ("FP32", [2], [None, 1.0], "mixed or null"),
    ("BOOL", [2], [None, True], "true/false"), ("BOOL", [2], [1, 0], "true/false"),
    ("INT64", [2], [1.0, 2], "must be integers, got floats"), ("INT32", [1], [1.5], "must be integers, got floats"),
    ("INT8", [2], [127, 128], "out of range for INT8"), ("INT8", [1], [-129], "out of range for INT8"),
    ("UINT8", [1], [256], "out of range for UINT8"), ("UINT8", [2], [0, -1], "out of range for UINT8"),
    ("INT64", [1], [2**70], "out of range for INT64"), ("FP16", [1], [1e5], "out of range for FP16"),
    ("FP32", [2], [1.0, math.nan], "NaN or infinity"), ("FP32", [1], [math.inf], "NaN or infinity"),
    ("BF16", [1], [-math.inf], "NaN or infinity"), ("FP32", [2, 3], [1, 2, 3, 4, 5], "needs 6 values, 'data' has 5"),
    ("FP32", [2, 3], [[1, 2], [3, 4], [5, 6]], "nested 'data' has shape [3, 2], not [2, 3]"),
    ("FP32", [2], {"a": 1}, "must be a list"), ("FP32", [1], 1.0, "must be a list"),
    ("BYTES", [1], ["abc"], "BYTES cannot be given as JSON"),
    ("FP32", [2], [True, 1.5], "FP32 data must be numbers, not true/false"),
    ("INT64", [2], [True, 2], "INT64 data must be numbers, not true/false"),
])
def test_from_json_refusals(datatype, shape, data, fragment):
    with pytest.raises(BadRequest) as info:
        from_json("pixels", datatype, shape, data)
    assert "'pixels'" in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize("datatype", sorted(TORCH_DTYPES))
def test_binary_round_trip(datatype):
    dtype, g = TORCH_DTYPES[datatype], torch.Generator().manual_seed(1)
    if dtype.is_floating_point:
        t = (torch.randn(3, 4, generator=g) * 100).to(dtype)
    else:  # bool and integers: small values (0 and 1 for bool)
        t = torch.randint(0, 2 if dtype == torch.bool else 100, (3, 4), generator=g).to(dtype)
    raw = to_binary(t)
    assert len(raw) == t.numel() * t.element_size()
    back = from_binary("x", datatype, [3, 4], raw)
    assert back.dtype == t.dtype and torch.equal(back, t)
    assert torch.equal(from_binary("x", datatype, [3, 4], memoryview(raw)), t)
    assert from_binary("x", datatype, [0, 4], b"").shape == (0, 4)
    with pytest.raises(BadRequest, match=r"'x'.*binary data has"):
        from_binary("x", datatype, [3, 4], raw[:-1])


def test_binary_refuses_nan_unless_told_and_unknown_types():
    raw = to_binary(torch.tensor([1.0, math.nan, 2.0]))
    with pytest.raises(BadRequest, match="'y': data contains NaN"):
        from_binary("y", "FP32", [3], raw)
    with pytest.raises(BadRequest, match="'y': data contains NaN"):
        from_binary("y", "BF16", [1], to_binary(torch.tensor([math.inf], dtype=torch.bfloat16)))
    assert torch.isnan(from_binary("y", "FP32", [3], raw, finite=False)[1])
    with pytest.raises(BadRequest, match="'y'.*BYTES"):
        from_binary("y", "BYTES", [1], b"abcd")


def test_to_json_data_widens_bf16():
    t = torch.tensor([[1.1, -2.7], [3e38, 1e-3]], dtype=torch.bfloat16)
    data = to_json_data(t)
    assert data == t.float().reshape(-1).tolist() and all(type(v) is float for v in data)
    assert to_json_data(torch.tensor([[1, 2], [3, 4]])) == [1, 2, 3, 4]


# ---------------------------------------------------------------------------------- endpoint
def _endpoint(zoo: str, **kw) -> Endpoint:
    return Endpoint(ModelConfig(name=zoo, zoo=zoo, **kw))


def test_zoo_inputs_and_check_orders_them():
    assert _endpoint("tiny_mlp").inputs == [TensorSpec(name="x", datatype="FP32", shape=[-1, 32])]
    assert _endpoint("tied_lm").inputs == [TensorSpec(name="ids", datatype="INT64", shape=[-1, 12], min=0, max=99)]
    ep = _endpoint("tiny_bert", max_batch=4)
    assert ep.inputs == [TensorSpec(name="input_ids", datatype="INT64", shape=[-1, 16], min=0, max=999),
                         TensorSpec(name="attention_mask", datatype="INT64", shape=[-1, 16], min=0, max=1)]
    ids, mask = torch.randint(0, 1000, (3, 16)), torch.ones(3, 16, dtype=torch.int64)
    assert ep.check({"attention_mask": mask, "input_ids": ids}) == ([ids, mask], 3)
    ordered, rows = _endpoint("tiny_mlp").check({"x": torch.zeros(8, 32)})
    assert rows == 8 and ordered[0].shape == (8, 32)


def _bert(rows=2, **over) -> dict:
    return {"input_ids": torch.randint(0, 1000, (rows, 16)), "attention_mask": torch.randint(0, 2, (rows, 16))} | over


@pytest.mark.parametrize("given,fragment", [
    (lambda: _bert(token_type_ids=torch.zeros(2, 16, dtype=torch.int64)), "no input 'token_type_ids'"),
    (lambda: {"input_ids": _bert()["input_ids"]}, "needs input 'attention_mask'"),
    (lambda: _bert(input_ids=torch.zeros(2, 16, dtype=torch.int32)), "'input_ids'.*must be INT64, got INT32"),
    (lambda: _bert(attention_mask=torch.ones(2, 15, dtype=torch.int64)), "'attention_mask'.*shape"),
    (lambda: _bert(input_ids=torch.zeros(16, dtype=torch.int64)), "'input_ids'.*shape"),
    (lambda: _bert(attention_mask=torch.ones(3, 16, dtype=torch.int64)), "batch size: 'attention_mask' has 3"),
    (lambda: _bert(input_ids=torch.full((2, 16), 1000)), r"'input_ids'.*values must lie in \[0, 999\]"),
    (lambda: _bert(input_ids=torch.full((2, 16), -1)), r"'input_ids'.*\[0, 999\]"),
    (lambda: _bert(attention_mask=torch.full((2, 16), 2)), r"'attention_mask'.*\[0, 1\]"),
    (lambda: _bert(5), "'tiny_bert' takes 1 to 4 rows.*got 5"), (lambda: _bert(0), "takes 1 to 4 rows.*got 0"),
])
def test_check_refusals(given, fragment):
    with pytest.raises(BadRequest, match=fragment):
        _endpoint("tiny_bert", max_batch=4).check(given())


@pytest.mark.parametrize("zoo", ["tiny_mlp", "tiny_bert", "tied_lm"])
def test_zoo_example_inputs_match_specs(zoo):
    ep = _endpoint(zoo, example_batch=3)
    example = ep.example_inputs()
    assert len(example) == len(ep.inputs)
    for t, spec in zip(example, ep.inputs):
        assert t.dtype == TORCH_DTYPES[spec.datatype] and t.shape[0] == 3 and list(t.shape[1:]) == spec.shape[1:]
    assert ep.check({s.name: t for s, t in zip(ep.inputs, example)})[1] == 3


def test_build_example_inputs_follow_specs():
    inputs = [TensorSpec(name="f", datatype="FP16", shape=[-1, 3]),
              TensorSpec(name="b", datatype="BOOL", shape=[-1, 2]),
              TensorSpec(name="i", datatype="INT32", shape=[-1, -1, 4], min=5, max=7)]
    ep = Endpoint(ModelConfig(name="built", build="pkg.mod:make", inputs=inputs, example_batch=2))
    f, b, i = ep.example_inputs()
    assert (f.dtype, f.shape) == (torch.float16, (2, 3)) and (b.dtype, b.shape) == (torch.bool, (2, 2))
    assert (i.dtype, i.shape) == (torch.int32, (2, 1, 4)) and 5 <= int(i.min()) and int(i.max()) <= 7
    assert ep.check({"f": f, "b": b, "i": i})[1] == 2


# take_batch -------------------------------------------------------------------------------
@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _pending(loop, rows, width=32, dtype=torch.float32, cancelled=False) -> Pending:
    p = Pending([torch.zeros(rows, width, dtype=dtype)], rows, loop.create_future())
    if cancelled:
        p.future.cancel()
    return p


def test_take_batch_groups_same_shapes_in_order(loop):
    ep = _endpoint("tiny_mlp", max_batch=4)
    assert ep.take_batch() == []
    a, b, c, d = _pending(loop, 1), _pending(loop, 2, width=16), _pending(loop, 1, cancelled=True), _pending(loop, 2)
    e, f = _pending(loop, 2), _pending(loop, 1, dtype=torch.float16)
    ep.queue.extend([a, b, c, d, e, f])
    assert ep.take_batch() == [a, d]  # e would make 5 rows; c is cancelled; b and f differ
    assert list(ep.queue) == [b, e, f]
    assert [ep.take_batch() for _ in range(4)] == [[b], [e], [f], []] and not ep.queue


def test_take_batch_skips_done_head_and_respects_batchable(loop):
    ep = _endpoint("tiny_mlp", max_batch=8)
    dead, done, a, b = _pending(loop, 1, cancelled=True), _pending(loop, 1), _pending(loop, 1), _pending(loop, 1)
    done.future.set_result(None)
    ep.queue.extend([dead, done, a, b])
    ep.batchable = False
    assert [ep.take_batch() for _ in range(2)] == [[a], [b]]
    ep.queue.extend([_pending(loop, 1, cancelled=True)])
    assert ep.take_batch() == [] and not ep.queue


# outputs -----------------------------------------------------------------------------------
def test_flatten_outputs_names():
    _Out = make_dataclass("_Out", ["logits", "extra", ("note", str, "skipped")])
    _NT = namedtuple("_NT", "start end")
    t, u, v = torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 1)
    assert flatten_outputs(t) == [("output", t)]
    assert flatten_outputs((t, u)) == [("output_0", t), ("output_1", u)]
    assert flatten_outputs([t, "x", None, 3]) == [("output_0", t)]
    assert flatten_outputs({"logits": t, "hidden": (u, v), "n": 1}) == [("logits", t), ("hidden_0", u), ("hidden_1", v)]
    assert flatten_outputs({"a": {"b": t}}) == [("a.b", t)]
    assert flatten_outputs(_Out(t, (u, 7))) == [("logits", t), ("extra_0", u)]
    assert flatten_outputs(_NT(t, u)) == [("start", t), ("end", u)]
    assert flatten_outputs("text") == []


def test_split_outputs():
    from timeshare.models.zoo import get

    zoo = get("tied_lm")
    with torch.no_grad():
        named = flatten_outputs(zoo.build()(*zoo.example_inputs(3)))
    assert [n for n, _ in named] == ["logits", "hidden_0", "hidden_1"]
    assert split_outputs(named, [1, 2]) is None  # hidden_1 is a 0-dim mean
    assert split_outputs(named[:2], [1, 2]) is not None
    a, b = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    parts = split_outputs([("a", a), ("b", b)], [1, 2, 3])
    assert [list(p) for p in parts] == [["a", "b"]] * 3
    assert torch.equal(parts[1]["a"], a[1:3]) and torch.equal(parts[2]["b"], b[3:])
    assert split_outputs([("a", a), ("s", torch.tensor(1.0))], [6]) is None
    assert split_outputs([("a", a), ("c", torch.zeros(5, 2))], [2, 4]) is None


def test_describe_outputs():
    named = [("a", torch.zeros(3, 10)), ("b", torch.zeros(5, 3, dtype=torch.int64)),
             ("c", torch.zeros(3, 3, dtype=torch.bfloat16))]
    assert describe_outputs(named, 3) == [OutputSpec("a", "FP32", [-1, 10]), OutputSpec("b", "INT64", [5, 3]),
                                          OutputSpec("c", "BF16", [-1, 3])]


def test_retry_after_grows_with_queue(loop):
    ep = _endpoint("tiny_mlp", max_batch=4)
    ep.batch_s, ep.load_s = 0.01, 0.01
    assert ep.retry_after(True) == 1 and ep.retry_after(False) == 1
    ep.batch_s, ep.load_s = 1.0, 5.0
    seen = []
    for _ in range(3):
        seen.append(ep.retry_after(True))
        ep.queue.extend(_pending(loop, 1) for _ in range(8))
    assert seen == sorted(seen) and seen[-1] > seen[0] and all(s >= 1 for s in seen)
    assert ep.retry_after(False) == ep.retry_after(True) + 5
    busy = ep.retry_after(True)
    ep.batchable = False  # one request per batch: a longer wait
    assert ep.retry_after(True) > busy


def test_leftovers_waits_for_a_child_that_is_leaving_and_reports_one_that_stays():
    import subprocess
    import sys

    from timeshare.harness.process import ServerProcess

    server = ServerProcess({"models": []})
    leaving = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    staying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        server.children = [leaving.pid]
        assert server.leftovers(grace_s=20) == []  # an exited, unreaped child (a zombie) counts as gone
        leaving.wait(10)
        server.children = [staying.pid]
        assert server.leftovers(grace_s=0.2) == [staying.pid]
        assert "time.sleep(60)" in server.describe(staying.pid)
    finally:
        staying.kill()
        staying.wait(10)
        server.close()


def test_the_worker_task_deadline_is_settable_and_defaults_to_the_request_timeout():
    from timeshare.server.service import Service

    assert parse_config({"runtime": {"task_timeout_s": 5}}).runtime.task_timeout_s == 5
    with pytest.raises(ConfigError, match="task_timeout_s"):
        parse_config({"runtime": {"task_timeout_s": 0}})
    for runtime, expected in (({}, 7.0), ({"task_timeout_s": 3}, 3.0)):
        service = Service(parse_config({"runtime": {"device": "cpu", "memory": "1MiB", **runtime},
                                        "server": {"request_timeout_s": 7}}))
        service.open()
        try:
            assert service.runtime.task_timeout_s == expected
        finally:
            service.runtime.close()


def test_a_non_resident_models_queue_lingers_only_while_the_runtime_thrashes():
    from timeshare.server.runner import QueueRunner

    class Runtime:  # stands in for the runtime's two readings the runner takes
        factor, resident = 1.0, {}

        def thrashing_factor(self):
            return self.factor

        def is_resident(self, name):
            return name in self.resident

    rt = Runtime()
    runner = QueueRunner(runtime=lambda: rt, executor=None, metrics=None, request_timeout_s=30.0)
    ep = Endpoint(ModelConfig(name="tiny_mlp", zoo="tiny_mlp"))
    ep.batch_s = 0.1
    assert runner.linger_s(ep) == 0.0  # not thrashing
    rt.factor = 3.0
    assert runner.linger_s(ep) == pytest.approx(0.2)  # two more batch durations
    rt.resident = {"tiny_mlp": 1}
    assert runner.linger_s(ep) == 0.0  # resident: nothing to amortize
    rt.resident, ep.batch_s = {}, 100.0
    assert runner.linger_s(ep) == pytest.approx(3.0)  # at most a tenth of the request timeout


@pytest.mark.parametrize("batches", [1, 2])
def test_in_front_of_a_cluster_a_models_batches_run_at_once(batches):
    """With ``batches`` 2 (a cluster of two replicas) two batches of one model are on their
    way together; with 1 the second waits for the first, so a call that needs both at
    once fails (the check can fail)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from timeshare.runtime.calls import Call
    from timeshare.runtime.events import CallRecord
    from timeshare.server.endpoint import ModelState
    from timeshare.server.runner import QueueRunner

    meet = threading.Barrier(2, timeout=2)

    class Backend:
        def thrashing_factor(self):
            return 1.0

        def is_resident(self, name):
            return True

        def call(self, name, args, kwargs=None, *, strategy=None, arrived_at=None):
            meet.wait()  # returns only when both batches are in flight
            return Call(args[0] * 2, CallRecord(name, time.monotonic(), 0.001, 0.0, False, None))

    class Metrics:
        def queued(self, model, seconds):
            pass

        def batched(self, model, rows):
            pass

    async def main():
        backend = Backend()
        with ThreadPoolExecutor(4) as pool:
            runner = QueueRunner(runtime=lambda: backend, executor=pool, metrics=Metrics(), request_timeout_s=30.0,
                                 batches=batches)
            ep = Endpoint(ModelConfig(name="tiny_mlp", zoo="tiny_mlp", batching=False))
            ep.state = ModelState.READY
            task = asyncio.create_task(runner.run(ep))
            loop = asyncio.get_running_loop()
            ps = [Pending([torch.full((1, 4), float(i))], 1, loop.create_future()) for i in range(2)]
            ep.queue.extend(ps)
            ep.wake.set()
            try:
                return await asyncio.wait_for(asyncio.gather(*[p.future for p in ps], return_exceptions=True), 20)
            finally:
                task.cancel()

    replies = asyncio.run(main())
    if batches == 2:
        assert [torch.equal(r.outputs["output"], torch.full((1, 4), 2.0 * i)) for i, r in enumerate(replies)] == \
            [True, True]
    else:
        assert all(isinstance(r, Exception) for r in replies)


def test_a_sequences_waiting_deltas_are_sent_as_one_and_nothing_is_reordered():
    """NOTE [Multi-step decode]: the text of a burst's tokens, waiting together, goes out
    in one chunk; a finish, another sequence's delta and the order between them stay."""
    from timeshare.llm.sequence import Delta, Finish
    from timeshare.server.openai import join_deltas

    end = Finish("stop", 3, 4, None)
    got = join_deltas([(0, Delta("a", 1)), (0, Delta("b", 2)), (1, Delta("x", 1)), (0, Delta("c", 3)),
                       (0, Delta("d", 4)), (0, end), (1, Delta("y", 2))])
    assert got == [(0, Delta("ab", 2)), (1, Delta("x", 1)), (0, Delta("cd", 4)), (0, end), (1, Delta("y", 2))]
    assert join_deltas([]) == [] and join_deltas([(2, end)]) == [(2, end)]
