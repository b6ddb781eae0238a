"""The HTTP app: the Open Inference Protocol (KServe v2) data plane with the binary
tensor data extension, Prometheus ``/metrics``, the error responses and the body-size
limit; the admin plane's routes (Triton's model repository extension, pinning, training
jobs) are ``server/admin.py``'s. Runs in the server's process and talks only to
:class:`~timeshare.server.service.Service`.

Errors are JSON ``{"error": "..."}`` with a status that says whose fault it is: 4xx
for the request (malformed, unknown model, too large), 503 with Retry-After for a full
queue (without it for a model that failed to load for good), 504 for a deadline; a 500
means a bug in timeshare.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from time import perf_counter_ns

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Route

from timeshare import __version__
from timeshare.errors import BadRequest, TimeshareError, UnknownModelError
from timeshare.server.admin import add_admin_plane
from timeshare.server.auth import ApiKey, Unauthorized, key_dependencies
from timeshare.server.embeddings import add_embeddings
from timeshare.server.hops import RequestTimes
from timeshare.server.openai import add_openai_api, openai_error
from timeshare.server.parsing import HEADER_LENGTH, describe_validation
from timeshare.server.schemas import InferenceRequest
from timeshare.server.service import Service
from timeshare.server.status import retry_headers, status_of
from timeshare.server.tensors import binary_view, datatype_of, to_json_data

log = logging.getLogger(__name__)


def create_app(service: Service, *, start: bool = True) -> FastAPI:
    """The ASGI app. With ``start``, its lifespan starts the service in the background
    (the server answers "live" at once and "ready" when the models are) and stops it
    (draining) at shutdown."""

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(service.start()) if start else None
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            await service.stop()

    described = service.config.server.openapi  # off: /openapi.json, /docs and /redoc are 404
    app = FastAPI(title="timeshare", version=__version__, lifespan=lifespan, default_response_class=SafeJSONResponse,
                  redirect_slashes=False,  # one path per resource: a trailing slash is a 404, not a redirect
                  openapi_url="/openapi.json" if described else None, docs_url="/docs" if described else None,
                  redoc_url="/redoc" if described else None,
                  description="Open Inference Protocol (v2) over a GPU time-shared between models and training jobs.")
    app.add_middleware(BodyLimit, limit=int(service.config.server.max_request_bytes))  # an int once validated
    key = ApiKey.of(service.config.server.resolved_api_key())  # NOTE [The data plane's key]
    _errors(app, service)
    _data_plane(app, service, key)
    add_admin_plane(app, service)
    add_openai_api(app, service, key)
    add_embeddings(app, service, key_dependencies(key))

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


# ---------------------------------------------------------------------- errors
def dump_json(content) -> bytes:
    """JSON that any client can parse: non-ASCII escaped (so text from a request, even a
    lone surrogate, cannot make encoding fail) and no NaN or infinity (ValueError)."""
    return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class SafeJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return dump_json(content)


def error_response(status: int, message: str, headers: dict | None = None, path: str = "",
                   code: str | None = None) -> JSONResponse:
    """An error as JSON: ``{"error": message}``, or in OpenAI's shape (with ``code``)
    under ``/v1``."""
    if path.startswith("/v1/"):
        return openai_error(status, message, headers=headers, code=code)
    return SafeJSONResponse({"error": message}, status_code=status, headers=headers)


def _errors(app: FastAPI, service: Service) -> None:
    @app.exception_handler(TimeshareError)
    async def timeshare_error(request: Request, exc: TimeshareError):
        status = status_of(exc)
        headers = retry_headers(exc, status)  # none for a model that failed for good
        code = "model_not_found" if isinstance(exc, UnknownModelError) else None
        return error_response(status, str(exc), headers, request.url.path, code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return error_response(400, describe_validation(exc.errors()), path=request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None), request.url.path,
                              getattr(exc, "code", None))  # Unauthorized's, for /v1

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, exc: ClientDisconnect):
        # The client left (or its body missed server.body_timeout_s): nobody reads this,
        # and a closed connection is no bug to log.
        return error_response(499, "the client disconnected")


ARRIVED = "timeshare.arrived"  # the scope's key for the first stamp of NOTE [Request hops]


class BodyLimit:
    """Request bodies over ``limit`` bytes get 413 (as JSON, like every error here):
    by Content-Length before the body is read, or as soon as a chunked body passes it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[ARRIVED] = perf_counter_ns()  # the request's first stamp (NOTE [Request hops])
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            response = error_response(413, f"request body of {int(declared)} bytes is over the limit of "
                                           f"{self.limit} (server.max_request_bytes)", path=scope.get("path", ""))
            return await response(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # reaches the HTTPException handler through request.body()
                    raise HTTPException(413, f"request body over the limit of {self.limit} bytes "
                                             "(server.max_request_bytes)")
            return message

        return await self.app(scope, limited, send)


# ---------------------------------------------------------------------- data plane
def _data_plane(app: FastAPI, service: Service, key: ApiKey | None) -> None:
    keyed = key_dependencies(key)  # NOTE [The data plane's key]: not the health routes

    @app.get("/v2", dependencies=keyed, summary="Server metadata")
    def server_metadata():
        return {"name": "timeshare", "version": __version__,
                "extensions": ["model_repository", "binary_tensor_data", "timeshare_training"]}

    @app.get("/v2/health/live", summary="Liveness: 200 while the process serves")
    def live():
        return {"live": True}

    @app.get("/v2/health/ready", summary="Readiness: 200 once every model that is not optional can serve")
    def ready():
        state = service.readiness()  # when not ready: why, and each model that cannot serve with its cause
        return SafeJSONResponse(state.to_json(), status_code=200 if state.ready else 400)

    @app.get("/v2/models/{model}", dependencies=keyed, summary="Model metadata")
    @app.get("/v2/models/{model}/versions/{version}", dependencies=keyed, include_in_schema=False)
    def model_metadata(model: str, version: str = "1"):
        return _versioned(service, model, version).metadata()

    @app.get("/v2/models/{model}/ready", dependencies=keyed, summary="Model readiness")
    @app.get("/v2/models/{model}/versions/{version}/ready", dependencies=keyed, include_in_schema=False)
    def model_ready(model: str, version: str = "1"):
        ep = _versioned(service, model, version)
        ok = ep.state.value == "READY"
        return SafeJSONResponse({"name": model, "ready": ok}, status_code=200 if ok else 400)

    infer_body = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": InferenceRequest.model_json_schema()},
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}

    # NOTE [The inference route]: a plain Starlette route, which FastAPI's router matches
    # first: FastAPI's own (dependency solving, path parameters through pydantic) cost a
    # request about 100 us on a CPU. The FastAPI route after it only documents the path.
    async def infer(request: Request) -> Response:
        if key is not None and not key.admits(request.headers.get("authorization")):
            raise Unauthorized()  # before the body is read (NOTE [The data plane's key])
        now = perf_counter_ns()
        times = RequestTimes(request.scope.get(ARRIVED, now), now)  # NOTE [Request hops]
        params = request.path_params
        model = params["model"]
        code = 500
        ep = None
        try:
            ep = _versioned(service, model, params.get("version", "1"))
            headers = request.headers
            declared = headers.get("content-length", "")
            service.parsers.admit(int(declared) if declared.isdigit() else None)  # 503 before reading, if full
            body = await request.body()
            times.read = perf_counter_ns()
            # Large JSON bodies are parsed in a parser process (NOTE [Parsing off the event loop]).
            req, tensors = await service.parsers.parse(body, headers.get(HEADER_LENGTH))
            times.parsed = perf_counter_ns()
            wanted = _requested_outputs(ep, req)
            reply = await service.infer_at(ep, tensors, times)
            times.resumed = perf_counter_ns()
            response = encode_reply(model, req, reply, wanted)
            times.encoded = perf_counter_ns()
            code = 200
            service.hops.add(times)
            return response
        except (asyncio.CancelledError, ClientDisconnect):
            code = 499  # the client went away, or shutdown gave up on it (nginx's code)
            raise
        except Exception as exc:
            code = status_of(exc)
            raise
        finally:
            if ep is not None or model in service.endpoints:
                seconds = (perf_counter_ns() - times.arrived) / 1e9 if code == 200 else None
                service.metrics.answered(model, code, seconds)

    for path in ("/v2/models/{model}/infer", "/v2/models/{model}/versions/{version}/infer"):
        app.router.routes.append(Route(path, infer, methods=["POST"]))

    @app.post("/v2/models/{model}/infer", dependencies=keyed, summary="Inference", openapi_extra=infer_body)
    async def infer_documented(model: str, request: Request):  # never reached: NOTE [The inference route]
        return await infer(request)


def _versioned(service: Service, model: str, version: str):
    ep = service.endpoint(model)
    if version != "1":
        raise HTTPException(404, f"model {model!r} has no version {version!r}; its versions: ['1']")
    return ep


def _requested_outputs(ep, req: InferenceRequest) -> list | None:
    if req.outputs is None:
        return None
    names = [o.name for o in req.outputs]
    if len(set(names)) != len(names):
        raise BadRequest(f"an output is requested twice: {names}")
    known = [o.name for o in ep.outputs]
    if known:
        unknown = [n for n in names if n not in known]
        if unknown:
            raise BadRequest(f"model {ep.name!r} has no output {unknown[0]!r}; its outputs are {known}")
    return req.outputs


def encode_reply(model: str, req: InferenceRequest, reply, wanted) -> Response:
    """JSON outputs, or with the binary extension (the request's ``binary_data_output``
    or an output's ``binary_data``) a JSON header followed by the outputs' bytes."""
    default_binary = bool((req.parameters or {}).get("binary_data_output", False))
    chosen = [(o.name, bool((o.parameters or {}).get("binary_data", default_binary))) for o in wanted] \
        if wanted is not None else [(n, default_binary) for n in reply.outputs]
    outputs: list[dict] = []
    blobs: list[bytes | memoryview] = []
    for name, binary in chosen:
        if name not in reply.outputs:
            raise BadRequest(f"model {model!r} has no output {name!r}; its outputs are {list(reply.outputs)}")
        t = reply.outputs[name]
        entry = {"name": name, "datatype": datatype_of(t.dtype), "shape": list(t.shape)}
        if binary:
            raw = binary_view(t)
            entry["parameters"] = {"binary_data_size": raw.nbytes}
            blobs.append(raw)
        else:
            entry["data"] = to_json_data(t)
        outputs.append(entry)
    params = {"timeshare_queue_ms": round(reply.queue_s * 1e3, 3),
              "timeshare_compute_ms": round(reply.compute_s * 1e3, 3),
              "timeshare_batch_rows": reply.batch_rows, "timeshare_loaded": reply.loaded}
    if reply.switched_from is not None:
        params["timeshare_switched_from"] = reply.switched_from
    body = {"model_name": model, "model_version": "1", "parameters": params, "outputs": outputs}
    if req.id is not None:
        body["id"] = req.id
    try:
        header = dump_json(body)
    except ValueError:
        bad = [o["name"] for o in outputs if "data" in o and not torch.isfinite(reply.outputs[o["name"]]).all()]
        raise BadRequest(f"model {model!r} produced NaN or infinity in output {bad[0] if bad else '?'!r} for these "
                         "inputs, which JSON cannot carry; ask for it with the binary tensor data extension") from None
    if not blobs:
        return Response(header, media_type="application/json")
    # The outputs' bytes are copied once, into the body (from views of the tensors).
    return Response(b"".join([header, *blobs]), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(header))})
