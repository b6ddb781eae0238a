"""Property-based fuzzing of the HTTP server: whatever a client sends, the answer is
never a 5xx, every error is JSON ``{"error": "..."}``, every 200 carries outputs of the
right names and shapes, and the server still serves afterwards. One real server (three
tiny CPU models) for the whole file; hypothesis is derandomized so CI is reproducible."""

from __future__ import annotations

import json
import math
import struct
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, Phase, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from tests.serving import running_server, tiny_config
from timeshare.models.zoo import get as zoo_get
from timeshare.server.tensors import to_binary, to_json_data

FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no explain phase: slow here
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
MODELS = {"mlp": "tiny_mlp", "cnn": "tiny_cnn", "bert": "tiny_bert"}
LIMIT = 65536


@pytest.fixture(scope="module")
def server():
    with running_server(tiny_config(server={"max_request_bytes": LIMIT})) as srv:
        # No keep-alive: uvicorn drops the connection after a 500, which would fail the next example.
        with httpx.Client(base_url=srv.url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            outputs = {m: {o["name"]: o for o in client.get(f"/v2/models/{m}").json()["outputs"]} for m in MODELS}
            assert all(outputs.values()), outputs  # name -> {"name", "datatype", "shape": [-1, ...]}
            srv.client, srv.outputs = client, outputs
            yield srv


def example_request(model: str, rows: int = 1) -> dict:
    zoo = zoo_get(MODELS[model])
    return {"inputs": [{"name": n, "shape": list(t.shape), "datatype": "FP32" if t.is_floating_point() else "INT64",
                        "data": to_json_data(t)} for n, t in zip(zoo.input_names, zoo.example_inputs(rows))]}


def check(r: httpx.Response, what, *, sent: dict | None = None, model: str | None = None,
          outputs: dict | None = None) -> dict | None:
    """The properties every answer has; the parsed JSON (header) of a 200. Given the
    request ``sent`` to ``model``'s inference route, a 200 must also carry the outputs
    asked for (``outputs``: the model's metadata), with the request's rows and id."""
    where = f"{what!r:.600} -> {r.status_code} {r.content[:300]!r}"
    if currently_in_test_context():  # --hypothesis-show-statistics shows the statuses
        event(str(r.status_code))
    if r.status_code >= 500:  # wait until the server has logged its traceback: in Python 3.11 that
        # (ast.parse, for the carets) races pytest formatting the failure (SystemError, INTERNALERROR)
        httpx.get(r.url.join("/v2/health/live"), timeout=30)
    assert r.status_code < 500, f"server error: {where}"
    if r.status_code != 200:
        try:
            body = r.json()
        except ValueError:
            raise AssertionError(f"error body is not JSON: {where}") from None
        assert isinstance(body, dict) and isinstance(body.get("error"), str), f"not a JSON error: {where}"
        return None
    n = r.headers.get("inference-header-content-length")
    body = json.loads(r.content[:int(n)] if n is not None else r.content)
    if model is not None:  # a 200 from an inference route
        assert isinstance(sent, dict) and outputs is not None, "check() needs the request and the output metadata"
        rows = sent["inputs"][0]["shape"][0]
        names = [o["name"] for o in body["outputs"]]
        wanted = [o["name"] for o in sent["outputs"]] if sent.get("outputs") is not None else list(outputs[model])
        assert names == wanted, f"outputs {names}, expected {wanted}: {where}"
        assert body.get("id") == sent.get("id"), f"id not echoed: {where}"
        blob = 0
        for o in body["outputs"]:
            meta = outputs[model][o["name"]]
            assert o["shape"] == [rows, *meta["shape"][1:]], f"{o['name']}: shape for {rows} rows? {where}"
            assert o["datatype"] == meta["datatype"], where
            if "data" in o:
                assert len(o["data"]) == math.prod(o["shape"]), where
            else:
                blob += o["parameters"]["binary_data_size"]
        if n is not None:
            assert len(r.content) == int(n) + blob, where
    return body


# ---------------------------------------------------------------------- strategies
# Strings include lone surrogates and control characters (json.dumps escapes them).
TEXT = st.text(max_size=8) | st.sampled_from(["x", "input_ids", "attention_mask", "\ud800", "\x00", "output"])
NUMBER = (st.integers(-3, 1000) | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
          | st.sampled_from([2**63, 2**64, -(2**63) - 1, 1e39, -1e39, 1e308, 65505.0, 0.5]))
JSON = st.recursive(st.none() | st.booleans() | NUMBER | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=10)
HUGE = st.sampled_from([2**31, 2**62, 2**63, 2**64, 2**70])
DIM = st.integers(-2, 40) | st.sampled_from([-1, 0, 10**6]) | HUGE
DATATYPE = st.sampled_from(["FP32", "INT64", "FP16", "FP64", "BF16", "INT32", "INT8", "UINT8", "UINT64", "BOOL",
                            "BYTES", "FP8", "fp32", "int64", "", "STRING"]) | TEXT
SOMETIMES = st.sampled_from([False, False, True])
MODEL = st.sampled_from([*MODELS] * 10 + ["", "nope", "MLP", "mlp ", "tiny_mlp", "\ud800", "a/b", None]).flatmap(
    lambda m: TEXT if m is None else st.just(m))  # mostly the served models
BAD_VALUE = st.sampled_from([None, "1", True, False, math.nan, math.inf, -math.inf, [], [1, 2], {}, 1.5, 1000, -1,
                             2**63, 2**64])


@st.composite
def near_valid(draw, model: str, outputs: dict) -> dict:
    """A valid request for ``model`` (or for another model), then a few mutations."""
    base = model if model in MODELS else draw(st.sampled_from(list(MODELS)))
    rows = draw(st.sampled_from([1, 1, 1, 2, 3, 0, 8, 9, 200]))
    req = example_request(base, rows)
    for inp in req["inputs"]:
        if draw(SOMETIMES):  # nested rows instead of a flat list
            width = len(inp["data"]) // max(rows, 1)
            inp["data"] = [inp["data"][i * width:(i + 1) * width] for i in range(rows)]
    if draw(SOMETIMES):
        req["id"] = draw(TEXT)
    if draw(SOMETIMES):
        req["parameters"] = draw(st.dictionaries(TEXT, JSON, max_size=2))
    if draw(SOMETIMES):
        names = draw(st.lists(st.sampled_from(list(outputs[base])) | st.sampled_from(["output_9", "nope"]) | TEXT,
                              max_size=3))
        req["outputs"] = [{"name": n, **draw(st.sampled_from([{}, {"parameters": {"binary_data": True}},
                                                               {"parameters": {"binary_data": "no"}}]))}
                          for n in names]
    if draw(SOMETIMES):
        req.setdefault("parameters", {})["binary_data_output"] = draw(st.booleans())
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))):
        inputs = req.get("inputs") if isinstance(req.get("inputs"), list) else []
        inp = draw(st.sampled_from(inputs)) if inputs else {}
        inp = inp if isinstance(inp, dict) else {}
        kind = draw(st.sampled_from([*range(14), *[12, 13] * 3]))  # the last two found bugs
        if kind == 0:
            inp["datatype"] = draw(DATATYPE)
        elif kind == 1:
            inp["shape"] = draw(st.lists(DIM, max_size=5))
        elif kind == 2 and isinstance(inp.get("data"), list) and inp["data"]:
            i = draw(st.integers(0, len(inp["data"]) - 1))
            inp["data"][i] = draw(BAD_VALUE | JSON)
        elif kind == 3:
            inp["data"] = draw(JSON)
        elif kind == 4:  # a field missing, at either level
            target = draw(st.sampled_from([req, inp]))
            if target:
                target.pop(draw(st.sampled_from(sorted(target))))
        elif kind == 5:  # an extra field
            draw(st.sampled_from([req, inp]))[draw(TEXT)] = draw(JSON)
        elif kind == 6:  # a field of the wrong JSON type
            target = draw(st.sampled_from([req, inp]))
            if target:
                target[draw(st.sampled_from(sorted(target)))] = draw(JSON)
        elif kind == 7 and inp:
            inputs.append(dict(inp))  # a duplicate name
        elif kind == 8:
            inp["name"] = draw(TEXT)
        elif kind == 9 and base == "bert" and isinstance(inp.get("data"), list) and inp["data"]:
            inp["data"] = [draw(st.integers(-5, 2000))] + inp["data"][1:]  # token ids out of range
        elif kind == 10:
            req["inputs"] = draw(st.sampled_from([[], {}, None, "x"]))
        elif kind == 11:
            inp["data"] = [[]] * draw(st.integers(0, 3))
        elif kind == 12:  # an empty tensor: a zero dimension, any others
            inp["shape"], inp["data"] = [0, *draw(st.lists(DIM, min_size=1, max_size=3))], []
        elif kind == 13:  # large but finite (in range for FP32) values everywhere
            inp["data"] = fill(inp.get("data"), draw(st.sampled_from([3e38, -3e38, 3e38, 1e30, 65504.0, 999, 1])))
    return req


def fill(data, value):
    return [fill(x, value) for x in data] if isinstance(data, list) else value


def post(client: httpx.Client, url: str, payload: bytes, headers=None, chunked: bool = False) -> httpx.Response:
    content = iter([payload[i:i + 8192] for i in range(0, len(payload), 8192)]) if chunked else payload
    return client.post(url, content=content, headers=headers)


# ---------------------------------------------------------------------- properties
@settings(FUZZ, max_examples=300)
@given(data=st.data(), model=MODEL, chunked=st.booleans())
def test_infer_fuzzed_json(server, data, model, chunked):
    req = data.draw(near_valid(model, server.outputs))
    payload = json.dumps(req, allow_nan=True).encode()
    r = post(server.client, f"/v2/models/{quote(model, safe='', errors='surrogatepass')}/infer", payload,
             {"content-type": "application/json"}, chunked)
    check(r, req, sent=req, model=model if model in MODELS else None, outputs=server.outputs)


# Named cases besides the fuzzing: all but "oversized" got a 500 when this file was written.
EMPTY_HUGE = {"inputs": [{"name": "x", "shape": [0, 2**70], "datatype": "FP32", "data": []}]}
CRASHERS = {
    "deeply-nested-json": b"[" * 50000,
    "deeply-nested-object": b'{"inputs": ' * 5000,
    "empty-tensor-huge-dim-json": json.dumps(EMPTY_HUGE).encode(),
    # empty, but its other dimensions multiply past numpy's size limit (found by the fuzzer)
    "empty-tensor-big-dims-json": json.dumps({"inputs": [{"name": "x", "shape": [0, 2**31, 2**31], "datatype": "FP32",
                                                          "data": []}]}).encode(),
    "empty-tensor-huge-dim-binary": json.dumps({"inputs": [{**EMPTY_HUGE["inputs"][0], "data": None,
                                                           "parameters": {"binary_data_size": 0}}]}).encode(),
    "oversized": b"x" * (LIMIT + 1),
    "huge-finite-inputs": json.dumps({"inputs": [{"name": "x", "shape": [1, 32], "datatype": "FP32",
                                                  "data": [3e38] * 32}]}).encode(),
    "lone-surrogate-id": json.dumps({**example_request("mlp"), "id": "\ud800"}).encode(),
}


@settings(FUZZ, max_examples=60)
@given(body=st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v, allow_nan=True).encode())
       | st.sampled_from([b"", b"{", b"\xef\xbb\xbf{}", b"null", b'"inputs"', b"[]"]),
       special=st.none() | st.sampled_from(sorted(CRASHERS)), model=st.sampled_from(["mlp", "bert"]))
def test_infer_garbage(server, body, special, model):
    body = CRASHERS[special] if special is not None else body
    check(post(server.client, f"/v2/models/{model}/infer", body), body[:300])


@pytest.mark.parametrize("name", sorted(CRASHERS))
def test_infer_regressions(server, name):
    check(post(server.client, "/v2/models/mlp/infer", CRASHERS[name]), name)


SIZE = st.integers(-10, 5000) | st.sampled_from([True, 1.5, "128", None, 2**70])
HEADER = (st.integers(-100, 5000).map(str) | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=6)
          | st.sampled_from(["", "1e3", "0x10", "-0", "+5", "1_0"]))  # printable: httpx refuses others


@settings(FUZZ, max_examples=120)
@given(data=st.data(), model=st.sampled_from([*MODELS, *MODELS, "nope"]))
def test_infer_fuzzed_binary(server, data, model):
    base = model if model in MODELS else "mlp"
    zoo = zoo_get(MODELS[base])
    tensors = zoo.example_inputs(data.draw(st.sampled_from([1, 2, 9])))
    header, blobs = {"inputs": []}, []
    for name, t in zip(zoo.input_names, tensors):
        raw, shape = to_binary(t), list(t.shape)
        choice = data.draw(st.sampled_from([0, 0, 0, 0, 1, 2, 3, 4, 5]))
        if choice == 1:
            raw = data.draw(st.binary(max_size=len(raw) + 8))
        elif choice == 2 and t.is_floating_point():  # a NaN or infinity in the first value
            raw = struct.pack("<f", data.draw(st.sampled_from([math.nan, math.inf]))) + raw[4:]
        elif choice == 5:  # an empty tensor: a zero dimension, any others
            raw, shape = b"", [0, *data.draw(st.lists(DIM, min_size=1, max_size=3))]
        entry = {"name": name, "shape": shape, "datatype": "FP32" if t.is_floating_point() else "INT64",
                 "parameters": {"binary_data_size": len(raw) if choice != 3 else data.draw(SIZE)}}
        if choice == 4:
            entry.update(data.draw(st.sampled_from([{"data": [1.0]}, {"shape": [-1, 32]}, {"datatype": "BYTES"},
                                                    {"datatype": "BOOL"}, {"parameters": {}}])))
        header["inputs"].append(entry)
        blobs.append(raw)
    if data.draw(st.booleans()):
        header["parameters"] = {"binary_data_output": data.draw(st.booleans())}
    head = json.dumps(header).encode()
    body = head + b"".join(blobs) + data.draw(st.sampled_from([b""] * 4 + [b"\x00", b"junk"]))
    length = data.draw(st.sampled_from([str(len(head))] * 6 + [None, str(len(body) + 1), "random"]))
    length = data.draw(HEADER) if length == "random" else length
    headers = {"content-type": "application/octet-stream"}
    if length is not None:
        headers["Inference-Header-Content-Length"] = length
    r = post(server.client, f"/v2/models/{model}/infer", body, headers)
    check(r, (header, length), sent=header, model=model if model in MODELS else None, outputs=server.outputs)


SEGMENT = (TEXT | MODEL | st.sampled_from(["1", "2", "..", ".", "%", "a/b", "nope"])).map(
    lambda s: quote(s, safe="", errors="surrogatepass"))
TRAINING = st.builds(  # a valid job would start training: every body has an unknown field
    lambda d, key: {**d, "zz_" + key: 1}, st.fixed_dictionaries(
        {"name": st.sampled_from(["fuzz-job", "", "-x", "a" * 70]) | TEXT,
         "model": st.sampled_from(list(MODELS.values()) + ["nope", "mlp"]) | TEXT},
        optional={"batch": NUMBER, "iterations": NUMBER | st.none(), "lr": NUMBER, "offload": JSON, "seed": NUMBER,
                  "start": JSON}), TEXT)
ADMIN_BODY = st.one_of(JSON.map(lambda v: json.dumps(v, allow_nan=True).encode()), st.binary(max_size=32),
                       st.sampled_from([b"", b"{}", b'{"parameters": {}}', b'{"ready": true}', b'{"ready": 1}']),
                       st.just(b"DEEP"))  # replaced by 30000 '[' in the test (a short repr)


@settings(FUZZ, max_examples=120)
@given(seg=SEGMENT, seg2=SEGMENT, kind=st.sampled_from(range(8)), body=ADMIN_BODY, training=TRAINING,
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
def test_other_routes(server, seg, seg2, kind, method, body, training):
    c = server.client
    body = b"[" * 30000 if body == b"DEEP" else body
    if kind == 0:
        r = c.request(method, f"/v2/models/{seg}")
    elif kind == 1:
        r = c.get(f"/v2/models/{seg}/ready")
    elif kind == 2:
        r = c.get(f"/v2/models/{seg}/versions/{seg2}")
    elif kind == 3:
        r = c.post(f"/v2/repository/models/{seg}/load", content=body)
    elif kind == 4:
        r = c.post("/v2/repository/index", content=body)
    elif kind == 5:
        r = c.post("/admin/training", content=json.dumps(training, allow_nan=True).encode())
        assert r.status_code != 201, "an invalid training job was accepted"
    elif kind == 6:
        r = c.get(f"/admin/training/{seg}")
    else:
        r = c.post(f"/v2/models/{seg}/versions/{seg2}/infer", content=body)
    check(r, (kind, method, seg, seg2, body[:200]))


@pytest.mark.parametrize("model", list(MODELS))
def test_still_serving_after_the_fuzz(server, model):
    """Runs after the fuzz tests (file order): every model answers, twice."""
    c = server.client
    assert c.get("/v2/health/ready").status_code == 200
    for _ in range(2):
        req = example_request(model, 2)
        r = c.post(f"/v2/models/{model}/infer", json=req)
        assert r.status_code == 200, r.text
        body = check(r, req, sent=req, model=model, outputs=server.outputs)
        for o in body["outputs"]:
            assert all(math.isfinite(v) for v in o["data"]), o["name"]
    assert server.service.start_error is None
    assert sorted(server.service.runtime.models()) == sorted(MODELS)


def test_metrics_count_the_status_sent(server):
    """timeshare_requests_total{code} counts the status the client got: a 404 for an
    unknown version and a 413 for an oversized chunked body are no 500s."""
    def count_500() -> float:
        line = 'timeshare_requests_total{code="500",model="mlp"} '
        return sum(float(x[len(line):]) for x in server.client.get("/metrics").text.splitlines() if x.startswith(line))

    before = count_500()
    assert server.client.post("/v2/models/mlp/versions/2/infer", content=b"{}").status_code == 404
    assert post(server.client, "/v2/models/mlp/infer", b"[" * (LIMIT + 1), chunked=True).status_code == 413
    assert count_500() == before, "responses other than 500 were counted as code=\"500\""
