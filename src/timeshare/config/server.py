"""The ``server`` and ``admin`` sections of ``timeshare.yaml``: where the HTTP server
listens and what it accepts (ports, limits, timeouts, parsing), and who may use the admin
plane and how much (the token, hosts, training jobs' limits). Runs in the server's process.
"""

from __future__ import annotations

import os
from typing import Annotated

from pydantic import Field, field_validator

from timeshare.config.fields import Strict, bytes_field
from timeshare.errors import ConfigError


class ServerConfig(Strict):
    """The HTTP server: where it listens and what it accepts."""

    host: str = "127.0.0.1"
    """The address to listen on: loopback by default, so that a server started without
    thought is not open to the network; "0.0.0.0" (or "::") opens it. The admin plane
    answers loopback clients only, unless ``admin.token`` is set."""
    api_key: str | None = None
    """When set, the data plane (``/v2`` metadata and inference, ``/v1``) needs
    "Authorization: Bearer <key>" and answers 401 without it; the health routes and
    /metrics stay open. ``timeshare serve --api-key`` overrides this field."""
    api_key_env: str | None = "TIMESHARE_API_KEY"
    """An environment variable to read the key from when ``api_key`` is not set (the
    file's key wins), so that the key need not sit in a file."""
    http_port: Annotated[int, Field(ge=0, le=65535)] = 8000
    """Open Inference Protocol, admin and /metrics (0: any free port)."""
    metrics_port: Annotated[int, Field(ge=0, le=65535)] | None = 8002
    """A second port that serves only /metrics (null: none)."""
    max_request_bytes: int | str = "64MiB"
    """Larger request bodies get 413."""
    request_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """A request not answered by then gets 504; what it queued is dropped."""
    drain_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """On Ctrl-C or SIGTERM: how long in-flight requests may take to finish."""
    warmup: bool = True
    """Run every model once at start-up (this profiles it) before the server is ready."""
    exit_on_error: bool = False
    """Exit with status 1 once start-up has ended if a model (or language model) that is not
    ``optional`` failed for good (its builder, its weights, its size), naming each, rather
    than serve the others; as Triton's ``--exit-on-error``. ``timeshare serve
    --exit-on-error`` sets it."""
    openapi: bool = False
    """Serve the API's description (/openapi.json, /docs, /redoc). Off by default: it maps
    the admin plane for anyone who can reach the port."""
    header_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """A connection must send a request's line and headers within this many seconds of
    opening, or of its previous answer; else it is closed (with 408 if it had sent part of
    them). Idle keep-alive connections close sooner, after uvicorn's 5 s."""
    body_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """A request's whole body must arrive within this many seconds of its headers, or the
    request gets 408 and its connection is closed: a client cannot hold a connection by
    trickling. Raise it for clients that upload large bodies over slow links."""
    max_header_bytes: int | str = "16KiB"
    """A request line plus headers over this size gets 431 and its connection is closed."""
    max_connections: Annotated[int, Field(ge=1)] = 1000
    """Connections beyond this many open ones get 503 at once and are closed."""
    parse_in_process_bytes: int | str = "1MiB"
    """JSON request bodies up to this size are parsed on the event loop; larger ones in a
    parser process, so that parsing them (seconds for tens of MB) stalls no other client."""
    parse_processes: Annotated[int, Field(ge=0, le=64)] = 2
    """Parser processes for large bodies (0: parse every body on the event loop). Each
    parses one body at a time, with a peak memory of about 6 times the body's size."""
    parse_queue: Annotated[int, Field(ge=0)] = 4
    """Large bodies that may wait for a busy parser; beyond that they get 503 with Retry-After."""

    @field_validator("max_request_bytes", "parse_in_process_bytes", mode="before")
    @classmethod
    def _limit(cls, v, info):
        return bytes_field(v, info.field_name)

    @field_validator("api_key")
    @classmethod
    def _printable_key(cls, v):
        if v is not None:
            check_api_key(v, "api_key")
        return v

    def resolved_api_key(self) -> str | None:
        """The data plane's key: ``api_key``, else the variable ``api_key_env`` names, else
        none (the data plane is open). A key from the environment is checked as one from
        the file is; a bad one is a :class:`ConfigError` naming the variable."""
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            value = os.environ.get(self.api_key_env) or None
            if value is not None:
                try:
                    check_api_key(value, f"${self.api_key_env}")
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
            return value
        return None

    @field_validator("max_header_bytes", mode="before")
    @classmethod
    def _header_limit(cls, v):
        n = bytes_field(v, "max_header_bytes")
        if n < 1024:
            raise ValueError("max_header_bytes must be at least 1 KiB")
        return n


def check_api_key(key: str, where: str) -> None:
    """An API key travels in an HTTP header, so it must be printable ASCII without spaces
    (what every client can send). ``where`` names the field or the variable it came from;
    the message never shows the key."""
    if not key:
        raise ValueError(f"{where} must not be empty (leave it out for an open data plane)")
    bad = sum(1 for c in key if not "!" <= c <= "~")
    if bad:
        raise ValueError(f"{where} must be printable ASCII without spaces (it is sent in an HTTP header); "
                         f"{bad} of its {len(key)} characters are not")


class AdminConfig(Strict):
    """The admin plane: the model repository (load, unload, index), pinning and training jobs."""

    enabled: bool = True
    token: str | None = None
    """When set, any client with "Authorization: Bearer <token>" may use the admin plane;
    without one, only loopback clients may."""
    token_env: str | None = "TIMESHARE_ADMIN_TOKEN"
    """An environment variable to read the token from when ``token`` is not set."""
    allowed_hosts: list[str] = []
    """Without a token, the admin plane accepts only requests whose Host (and Origin, when
    present) names localhost or a loopback address, so that a web page the operator visits
    cannot drive it (DNS rebinding, cross-site POSTs). Names added here are accepted too."""
    max_training_batch: Annotated[int, Field(ge=1)] = 256
    """Training jobs submitted through the admin plane (not those of this file) take at
    most this batch; a larger one gets 400."""
    max_training_iterations: Annotated[int, Field(ge=1)] | None = 1_000_000
    """Submitted training jobs must give ``iterations``, at most this many (null: no limit,
    and jobs that run until cancelled may be submitted)."""
    max_training_jobs: Annotated[int, Field(ge=1)] = 4
    """A submission while this many training jobs run (those of this file included) gets 409."""
    max_finished_jobs: Annotated[int, Field(ge=0)] = 32
    """Finished training jobs (done, failed or cancelled) kept for status queries; the
    oldest are forgotten first."""

    def resolved_token(self) -> str | None:
        if self.token:
            return self.token
        if self.token_env:
            return os.environ.get(self.token_env) or None
        return None
