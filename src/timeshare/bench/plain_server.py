"""The baseline of ``bench serve``: the HTTP server a user would write around plain
PyTorch, with the same Open Inference Protocol request and response (JSON or the binary
tensor data extension), so that the same client drives both. Every model is built from
the zoo with the same weights and stays resident; one lock around the forward, which
runs in Starlette's thread pool; no batching, no checks beyond what parsing needs.
Runs in its own process (``python -m timeshare.bench.plain_server``, started by
:class:`PlainServerProcess`) or, for tests, in the caller's (:func:`create_plain_app`).

It stamps its own hops like timeshare's server (NOTE [Request hops]) with the same
clock and sums them at ``GET /stats``: route, read, parse, to_thread, forward, to_loop,
encode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from time import perf_counter_ns

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from timeshare.dtypes import DATATYPES, TORCH_DTYPES
from timeshare.errors import TimeshareError
from timeshare.models.weights import read_weights
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.server.endpoint import flatten_outputs

HEADER_LENGTH = "inference-header-content-length"
PLAIN_HOPS = ("route", "read", "parse", "to_thread", "forward", "to_loop", "encode")
ARRIVED = "plain.arrived"


class _Arrival:
    """The first stamp, where timeshare's server takes it (its first middleware)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        scope[ARRIVED] = perf_counter_ns()
        await self.app(scope, receive, send)


def load_models(names: list[str], device: torch.device) -> dict[str, tuple[torch.nn.Module, list[str]]]:
    """Each zoo model with its weights file's values, in eval mode on ``device``, and
    its inputs' names in the forward's order."""
    out = {}
    for name in names:
        zoo = zoo_get(name)
        module = zoo.build()
        module.load_state_dict(read_weights(str(weights_path(name))), strict=False)
        out[name] = (module.eval().to(device), list(zoo.input_names))
    return out


def create_plain_app(models: dict[str, tuple[torch.nn.Module, list[str]]], device: torch.device):
    """The FastAPI app: ``POST /v2/models/{model}/infer``, ``GET /v2/health/ready``,
    ``GET /stats`` (the hops' sums)."""
    app = FastAPI()
    app.add_middleware(_Arrival)
    lock = threading.Lock()
    sums = [0] * len(PLAIN_HOPS)
    count = [0]

    def forward(module: torch.nn.Module, args: list[torch.Tensor]):
        start = perf_counter_ns()
        with lock, torch.inference_mode():
            out = module(*[a.to(device) for a in args])
            named = [(n, t.cpu()) for n, t in flatten_outputs(out)]
        return named, start, perf_counter_ns()

    @app.get("/v2/health/ready")
    def ready():
        return {"ready": True}

    @app.get("/stats")
    def stats():
        return {"requests": count[0], "hop_seconds": {h: ns / 1e9 for h, ns in zip(PLAIN_HOPS, sums)}}

    @app.post("/v2/models/{model}/infer")
    async def infer(model: str, request: Request):
        routed = perf_counter_ns()
        if model not in models:
            return JSONResponse({"error": f"no model {model!r}"}, status_code=404)
        module, input_names = models[model]
        body = await request.body()
        t_read = perf_counter_ns()
        n = request.headers.get(HEADER_LENGTH)
        head = json.loads(body[:int(n)] if n is not None else body)
        raw, offset, given = memoryview(body)[int(n) if n is not None else len(body):], 0, {}
        for inp in head["inputs"]:
            dtype = TORCH_DTYPES[inp["datatype"]]
            size = (inp.get("parameters") or {}).get("binary_data_size")
            if size is None:
                t = torch.tensor(inp["data"], dtype=dtype)
            else:
                t = torch.frombuffer(bytearray(raw[offset:offset + size]), dtype=dtype)
                offset += size
            given[inp["name"]] = t.reshape(inp["shape"])
        args = [given[name] for name in input_names]
        t_parsed = perf_counter_ns()
        named, start, end = await run_in_threadpool(forward, module, args)
        t_resumed = perf_counter_ns()
        binary = bool((head.get("parameters") or {}).get("binary_data_output", False))
        outputs, blobs = [], []
        for name, t in named:
            entry: dict = {"name": name, "datatype": DATATYPES[t.dtype], "shape": list(t.shape)}
            if binary:
                blob = t.contiguous().numpy().tobytes()
                entry["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                entry["data"] = t.reshape(-1).tolist()
            outputs.append(entry)
        reply = {"model_name": model, "model_version": "1", "outputs": outputs}
        if "id" in head:
            reply["id"] = head["id"]
        header = json.dumps(reply).encode()
        response = Response(header + b"".join(blobs), media_type="application/octet-stream",
                            headers={"Inference-Header-Content-Length": str(len(header))}) if binary else \
            Response(header, media_type="application/json")
        arrived = request.scope.get(ARRIVED, routed)
        stamps = (arrived, routed, t_read, t_parsed, start, end, t_resumed, perf_counter_ns())
        for i, (a, b) in enumerate(zip(stamps, stamps[1:])):
            sums[i] += b - a
        count[0] += 1
        return response

    return app


class PlainServerProcess:
    """``with PlainServerProcess(models, device) as plain: ... plain.url ...``: the
    baseline in a child process on a free loopback port, ready when entered, terminated
    (then killed) when left."""

    def __init__(self, models: list[str], device: str = "cpu", *, ready_timeout_s: float = 120.0):
        from timeshare.harness.process import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.models, self.device, self.ready_timeout_s = models, device, ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="timeshare-plain-")
        self.log_path = Path(self._dir.name) / "server.log"

    def __enter__(self) -> PlainServerProcess:
        import httpx

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:  # a file, not a pipe: nobody reads it while the server runs
            self.proc = subprocess.Popen([sys.executable, "-m", "timeshare.bench.plain_server", "--port",
                                          str(self.port), "--device", self.device, "--models", *self.models],
                                         env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                err = self.log_path.read_text(errors="replace")[-2000:]
                self._dir.cleanup()
                raise TimeshareError(f"the plain-PyTorch server exited with code {self.proc.returncode}: {err}")
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise TimeshareError(f"the plain-PyTorch server was not ready within {self.ready_timeout_s:.0f} s")
            time.sleep(0.2)

    def stats(self) -> dict:
        import httpx

        return httpx.get(f"{self.url}/stats", timeout=10).json()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._dir.cleanup()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from timeshare.device import resolve_device

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", nargs="+", required=True)
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    models = load_models(args.models, device)
    for name, (module, _) in models.items():  # one forward each, as timeshare's warm-up does
        with torch.inference_mode():
            module(*[a.to(device) for a in zoo_get(name).example_inputs(1)])
    uvicorn.run(create_plain_app(models, device), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
