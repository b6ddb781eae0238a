"""The admin plane's routes: Triton's model repository extension (index, load, unload),
pinning, training jobs and ``/admin/status``, all behind one guard: a bearer token when
``admin.token`` is set, else loopback clients only, with the Host and Origin checked
against DNS rebinding and cross-site requests. Runs in the server's process and talks
only to :class:`~timeshare.server.service.Service`.
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from timeshare.errors import BadRequest
from timeshare.server.parsing import describe_validation, load_json
from timeshare.server.ps import add_ps_route
from timeshare.server.schemas import RepositoryIndexRequest, TrainingRequest
from timeshare.server.service import Service


def add_admin_plane(app: FastAPI, service: Service) -> None:
    """The admin routes on ``app``, each behind the guard."""
    guard = [Depends(_guard(service))]
    # Admin bodies are small JSON objects, read only once the guard let the request
    # through, and parsed on the event loop: larger ones are refused (413).
    limit = int(service.config.server.parse_in_process_bytes)
    _repository_routes(app, service, guard, limit)
    _pinning_routes(app, service, guard, limit)
    _adapter_routes(app, service, guard, limit)
    _training_routes(app, service, guard, limit)
    _replica_routes(app, service, guard)
    _status_route(app, service, guard)
    add_ps_route(app, service, guard)


def _guard(service: Service):
    """The dependency every admin route has: the plane enabled, then the bearer token when
    ``admin.token`` is set, else a loopback client with a local Host and Origin."""
    cfg = service.config.admin
    token = cfg.resolved_token()

    def admin(request: Request) -> None:
        if not cfg.enabled:
            raise HTTPException(403, "the admin plane is disabled (admin.enabled: false)")
        if token is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise HTTPException(401, "the admin plane needs 'Authorization: Bearer <admin token>'",
                                    headers={"WWW-Authenticate": "Bearer"})
            return
        host = request.client.host if request.client else ""
        if not is_loopback(host):
            raise HTTPException(403, "the admin plane answers loopback clients only; set admin.token (or "
                                     "$TIMESHARE_ADMIN_TOKEN) to use it from elsewhere")
        # A loopback peer may still be a browser running someone else's page: the Host of a
        # rebound DNS name, or the Origin of a cross-site request, gives it away.
        named = _hostname(request.headers.get("host", ""))
        if not _local_name(named, cfg.allowed_hosts):
            raise HTTPException(403, f"the admin plane refuses Host {named or '(none)'!r}: only localhost, loopback "
                                     "addresses and admin.allowed_hosts")
        origin = request.headers.get("origin")
        if origin is not None and not _local_name(_hostname(origin, url=True), cfg.allowed_hosts):
            raise HTTPException(403, f"the admin plane refuses cross-site requests (Origin {origin!r})")

    return admin


def _repository_routes(app: FastAPI, service: Service, guard: list, limit: int) -> None:
    """Triton's model repository extension: index, load, unload."""

    @app.post("/v2/repository/index", dependencies=guard, summary="Models in the repository and their state")
    async def repository_index(request: Request):
        body = await _optional_json(request, limit)
        try:
            opts = RepositoryIndexRequest.model_validate(body)
        except ValidationError as exc:
            raise _invalid(exc) from None
        return service.index(ready_only=opts.ready)

    # ``:path``: a language model may be named as a repository id ("org/model").
    @app.post("/v2/repository/models/{model:path}/load", dependencies=guard, summary="Load a model onto the device")
    async def load(model: str, request: Request):
        await _no_parameters(request, "load", limit)
        await service.load(model)
        return {}

    @app.post("/v2/repository/models/{model:path}/unload", dependencies=guard,
              summary="Unload a model: finish its queue, free its device and host memory")
    async def unload(model: str, request: Request):
        await _no_parameters(request, "unload", limit)
        await service.unload(model)
        return {}


def _pinning_routes(app: FastAPI, service: Service, guard: list, limit: int) -> None:
    """Add a language model at run time; pin a model (loaded now, never evicted) and unpin it."""

    @app.post("/admin/models", dependencies=guard, status_code=201,
              summary='Serve a language model from now on: {"model": a directory or org/model, "name": optional}')
    async def add_model(request: Request):
        body = await _optional_json(request, limit)
        source, name = body.get("model"), body.get("name")
        unknown = sorted(set(body) - {"model", "name"})
        if not isinstance(source, str) or not source or (name is not None and not isinstance(name, str)) or unknown:
            raise BadRequest('the body must be {"model": "a Hugging Face directory or org/model in the local '
                             'cache", "name": "optional"}' + (f"; unknown fields: {unknown}" if unknown else ""))
        cfg = await service.add_llm(source, name)
        return {"name": cfg.name, "kind": "language model", "path": cfg.path}

    @app.post("/admin/models/{model:path}/pin", dependencies=guard, summary="Pin: load now, never evict")
    async def pin(model: str):
        await service.pin(model, True)
        return {"name": model, "pinned": True}

    @app.post("/admin/models/{model:path}/unpin", dependencies=guard, summary="Unpin: evictable again")
    async def unpin(model: str):
        await service.pin(model, False)
        return {"name": model, "pinned": False}


def _adapter_routes(app: FastAPI, service: Service, guard: list, limit: int) -> None:
    """vLLM's routes and bodies for LoRA adapters at run time (NOTE [Adapter residency]),
    answered as vLLM answers them (plain text)."""

    @app.post("/v1/load_lora_adapter", dependencies=guard, response_class=PlainTextResponse,
              summary='Serve a LoRA adapter: {"lora_name", "lora_path", "base_model_name": optional}')
    async def load_lora_adapter(request: Request):
        body = await _optional_json(request, limit)
        name, path, base = body.get("lora_name"), body.get("lora_path"), body.get("base_model_name")
        unknown = sorted(set(body) - {"lora_name", "lora_path", "base_model_name", "lora_int_id", "load_inplace"})
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path or \
                (base is not None and not isinstance(base, str)) or unknown:
            raise BadRequest('the body must be {"lora_name": "...", "lora_path": "an adapter directory", '
                             '"base_model_name": "optional"}' + (f"; unknown fields: {unknown}" if unknown else ""))
        if body.get("load_inplace") not in (None, True, False):
            raise BadRequest("load_inplace must be true or false")
        await service.add_adapter(name, path, base, replace=bool(body.get("load_inplace")))
        return f"Success: LoRA adapter '{name}' added successfully."

    @app.post("/v1/unload_lora_adapter", dependencies=guard, response_class=PlainTextResponse,
              summary='Stop serving a LoRA adapter: {"lora_name"}')
    async def unload_lora_adapter(request: Request):
        body = await _optional_json(request, limit)
        name = body.get("lora_name")
        unknown = sorted(set(body) - {"lora_name", "lora_int_id"})
        if not isinstance(name, str) or not name or unknown:
            raise BadRequest('the body must be {"lora_name": "..."}' + (f"; unknown fields: {unknown}" if unknown
                                                                      else ""))
        await service.remove_adapter(name)
        return f"Success: LoRA adapter '{name}' removed successfully."


def _training_routes(app: FastAPI, service: Service, guard: list, limit: int) -> None:
    """Training jobs: list, submit, status, and pause, resume, cancel or migrate."""

    @app.get("/admin/training", dependencies=guard, summary="Training jobs")
    def jobs():
        return [service.job_status(n) for n in service.job_names()]

    training_body = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": TrainingRequest.model_json_schema()}}}}

    @app.post("/admin/training", dependencies=guard, status_code=201, summary="Start a training job",
              openapi_extra=training_body)
    async def submit(request: Request):
        # Read here, after the guard: a body parameter would be read and parsed before it.
        try:
            job = TrainingRequest.model_validate(await _optional_json(request, limit))
        except ValidationError as exc:
            raise _invalid(exc) from None
        return await service.submit_training(job)

    @app.get("/admin/training/{job}", dependencies=guard, summary="A training job's status")
    def job(job: str):
        return service.job_status(job)

    @app.post("/admin/training/{job}/{action}", dependencies=guard,
              summary="pause, resume or cancel a training job (on a cluster also: migrate)")
    def control(job: str, action: str):
        return service.control_job(job, action)


def _replica_routes(app: FastAPI, service: Service, guard: list) -> None:
    """A cluster's replicas: list them, add one, kill one (a drill). Without a cluster
    there are no replicas to name: these paths are 404, saying why."""
    if service.config.cluster is None:
        guard = [*guard, Depends(_no_cluster)]

    @app.get("/admin/replicas", dependencies=guard, summary="A cluster's replicas and its counters")
    def replicas():
        return service.replicas()

    @app.post("/admin/replicas", dependencies=guard, status_code=201, summary="Add a replica to the cluster")
    async def add_replica():
        return await service.add_replica()

    @app.post("/admin/replicas/{replica}/kill", dependencies=guard,
              summary="Kill a replica (a drill: its requests are retried on the others)")
    def kill_replica(replica: str):
        return service.kill_replica(replica)


async def _no_cluster() -> None:
    raise HTTPException(404, "this server runs no cluster (its config has no 'cluster' section), so it has no "
                             "replicas")


def _status_route(app: FastAPI, service: Service, guard: list) -> None:
    """``/admin/status``: the runtime's snapshot, readiness and the models' states."""

    @app.get("/admin/status", dependencies=guard, summary="Runtime state: memory, residency, counters")
    def status():
        snap = service.snapshot().to_json()
        snap["not_ready_reason"] = service.not_ready_reason()
        snap["ready"] = snap["not_ready_reason"] is None
        snap["start_error"] = service.start_error
        snap["models"] = service.index()
        return snap


def _invalid(exc: ValidationError) -> BadRequest:
    """A request body that failed validation, each error as ``field: message``; the
    messages of our own validators without pydantic's "Value error, " before them."""
    errors = [{**e, "msg": e.get("msg", "invalid").removeprefix("Value error, ")} for e in exc.errors()]
    return BadRequest(describe_validation(errors))


def _hostname(value: str, *, url: bool = False) -> str:
    """The host name of a Host header ("name:port", "[::1]:port") or of an Origin URL."""
    try:
        return (urlsplit(value if url else f"//{value}").hostname or "").lower()
    except ValueError:
        return ""


def _local_name(name: str, allowed: list[str]) -> bool:
    return name == "localhost" or is_loopback(name) or name in {a.lower() for a in allowed}


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _optional_json(request: Request, limit: int) -> dict:
    """An admin request's body: a JSON object ({} when empty) of at most ``limit`` bytes."""
    body = await request.body()
    if len(body) > limit:
        raise HTTPException(413, f"admin request bodies are at most {limit} bytes (server.parse_in_process_bytes); "
                                 f"this one has {len(body)}")
    if not body.strip():
        return {}
    obj = load_json(body)
    if not isinstance(obj, dict):
        raise BadRequest("the request body must be a JSON object")
    return obj


async def _no_parameters(request: Request, what: str, limit: int) -> None:
    """Triton's load and unload take optional parameters (config overrides, files);
    timeshare's models come from its config file, so none are accepted."""
    body = await _optional_json(request, limit)
    extra = sorted(k for k, v in body.items() if not (k == "parameters" and not v))
    if extra:
        raise BadRequest(f"{what} takes no {extra[0]!r} here: models are defined in the server's config file")
