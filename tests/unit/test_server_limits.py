"""Unit tests of the server's limits against hostile clients, the pure parts: the config
fields, training submission bounds, request-head sizes and which bodies are parsed off
the event loop. The mechanisms themselves: tests/integration/test_server_hostile.py."""

from __future__ import annotations

import h11
import pytest

from timeshare.config import AdminConfig, TrainingConfig, parse_config
from timeshare.errors import BadRequest, ConfigError
from timeshare.server.admission import check_training, training_state_bytes
from timeshare.server.connections import ConnectionLimits, head_size
from timeshare.server.parser_pool import ParserPool
from timeshare.server.parsing import json_size, parse_infer


def test_hardening_defaults_and_their_validation():
    s = parse_config({}).server
    assert (s.openapi, s.header_timeout_s, s.body_timeout_s, s.max_header_bytes, s.max_connections) == \
        (False, 10.0, 30.0, 16 << 10, 1000)
    assert (s.parse_in_process_bytes, s.parse_processes, s.parse_queue) == (1 << 20, 2, 4)
    a = parse_config({}).admin
    assert (a.max_training_batch, a.max_training_iterations, a.max_training_jobs, a.max_finished_jobs) == \
        (256, 1_000_000, 4, 32)
    s = parse_config({"server": {"max_header_bytes": "8KiB", "parse_in_process_bytes": "2MiB"}}).server
    assert ConnectionLimits.from_config(s) == ConnectionLimits(10.0, 30.0, 8192, 1000)
    assert s.parse_in_process_bytes == 2 << 20
    assert parse_config({"admin": {"max_training_iterations": None}}).admin.max_training_iterations is None
    for bad, message in [
            ({"server": {"max_header_bytes": 100}}, "server.max_header_bytes: max_header_bytes must be at least 1 KiB"),
            ({"server": {"parse_in_process_bytes": "lots"}},
             "server.parse_in_process_bytes: parse_in_process_bytes 'lots' is not a size"),
            ({"server": {"header_timeout_s": 0}}, "server.header_timeout_s:"),
            ({"server": {"max_connections": 0}}, "server.max_connections:"),
            ({"server": {"parse_processes": -1}}, "server.parse_processes:"),
            ({"admin": {"max_training_jobs": 0}}, "admin.max_training_jobs:")]:
        with pytest.raises(ConfigError) as exc:
            parse_config(bad)
        assert str(exc.value).startswith(f"config: {message}"), exc.value


def _job(**kw) -> TrainingConfig:
    return TrainingConfig.model_validate({"name": "j", "model": "tiny_mlp", "iterations": 10, **kw})


def test_training_state_is_parameters_gradients_and_momentum_in_fp32():
    assert training_state_bytes("tiny_mlp") == 12 * 6_922
    assert training_state_bytes("resnet152") == 12 * 60_192_808  # 722 MB: more than the demo's 600 MiB budget


@pytest.mark.parametrize("job, admin, message", [
    (_job(batch=257), {}, "training job 'j': batch 257 is over the limit of 256 (admin.max_training_batch)"),
    (_job(iterations=None), {}, "training job 'j': give 'iterations' (at most 1000000, admin.max_training_iterations)"),
    (_job(iterations=11), {"max_training_iterations": 10}, "training job 'j': 11 iterations are over the limit of 10 "
                                                          "(admin.max_training_iterations)"),
    (_job(model="resnet152"), {}, "training job 'j': model 'resnet152' needs at least 688.9 MiB for its parameters, "
                                  "gradients and optimizer state, more than the device memory budget of 600.0 MiB "
                                  "(runtime.memory)"),
])
def test_training_submissions_out_of_bounds_are_refused_with_the_bound_named(job, admin, message):
    with pytest.raises(BadRequest) as exc:
        check_training(job, AdminConfig(**admin), budget_bytes=600 << 20)
    assert str(exc.value).startswith(message)


def test_training_submissions_within_bounds_pass():
    check_training(_job(batch=256, iterations=1_000_000), AdminConfig(), budget_bytes=12 * 6_922)
    check_training(_job(iterations=None), AdminConfig(max_training_iterations=None), budget_bytes=1 << 20)


def test_head_size_counts_the_request_line_and_headers():
    small = h11.Request(method="GET", target="/v2", headers=[("Host", "x")])
    assert head_size(small) == len(b"GET /v2 HTTP/1.1\r\nHost: x\r\n")
    big = h11.Request(method="GET", target="/v2", headers=[("Host", "x"), ("X-Pad", "a" * 20_000)])
    assert 20_000 < head_size(big) < 20_100


def test_which_bodies_are_parsed_off_the_event_loop():
    assert json_size(b"x" * 10, None) == 10
    assert json_size(b"x" * 10, "4") == 4  # the binary extension: only its JSON header counts
    assert json_size(b"x" * 10, "11") == json_size(b"x" * 10, "nope") == 0  # refused before any JSON is read
    pool = ParserPool(in_process_bytes=1 << 20, processes=1, queue=1, timeout_s=1)
    assert not pool.offloads(1 << 20) and pool.offloads((1 << 20) + 1)
    assert not ParserPool(in_process_bytes=0, processes=0, queue=0, timeout_s=1).offloads(1 << 30)
    pool.close()  # nothing had started


def test_parse_infer_returns_the_request_without_its_data_and_keeps_pydantics_messages():
    req, tensors = parse_infer(b'{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[1,2]}]}', None)
    assert req.inputs[0].data is None and tensors["x"].tolist() == [1, 2]
    with pytest.raises(BadRequest, match=r"^invalid request: inputs.0.data: Input should be a valid list$"):
        parse_infer(b'{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":"12"}]}', None)
    with pytest.raises(BadRequest, match=r"^invalid request: inputs.0.colour: Extra inputs are not permitted$"):
        parse_infer(b'{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[1,2],"colour":1}]}', None)
    header = (b'{"inputs":[{"name":"x","datatype":"INT32","shape":[2],"data":[1,2],'
              b'"parameters":{"binary_data_size":8}}]}')
    with pytest.raises(BadRequest, match="give either 'data' or binary_data_size, not both"):
        parse_infer(header + bytes(8), str(len(header)))
