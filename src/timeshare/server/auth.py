"""The data plane's API key (``server.api_key``, or the variable ``server.api_key_env``
names): what the Open Inference Protocol's metadata and inference routes and the OpenAI
routes ask of a client when a key is set. Runs in the server's process, in the routes.

NOTE [The data plane's key]: with a key, every route under ``/v2`` and ``/v1`` needs
"Authorization: Bearer <key>", except the health routes (``/v2/health/live`` and
``/ready``, for probes and load balancers) and the model repository's (the admin plane's,
which keeps its own token rules, ``server/admin.py``); ``/metrics`` stays open as well, as
vLLM's ``--api-key`` leaves ``/health`` and ``/metrics``. A refused request gets 401 with
"WWW-Authenticate: Bearer" and the error in its path's shape (OpenAI's under ``/v1``),
before its body is read. The FastAPI routes take :meth:`ApiKey.dependencies`; the plain
inference route (NOTE [The inference route]) calls :meth:`ApiKey.admits` itself, one
header read and a comparison. tests/integration/test_server_auth.py walks every route of
the app, so that a route added later without the check fails it.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, Request
from starlette.exceptions import HTTPException

AUTHENTICATE = {"WWW-Authenticate": "Bearer"}


class Unauthorized(HTTPException):
    """401: the request lacks the data plane's key or gives another. ``code`` is what
    OpenAI's errors say of a wrong key (``/v1``'s error shape carries it)."""

    code = "invalid_api_key"

    def __init__(self) -> None:
        super().__init__(401, "this server needs 'Authorization: Bearer <API key>' (server.api_key)",
                         headers=AUTHENTICATE)


class ApiKey:
    """The key, checked in constant time against a request's Authorization header."""

    __slots__ = ("_expected",)

    def __init__(self, key: str) -> None:
        self._expected = f"Bearer {key}"  # printable ASCII (ServerConfig checks the key)

    @classmethod
    def of(cls, key: str | None) -> ApiKey | None:
        """None for no key: the data plane is open and its routes check nothing."""
        return None if key is None else cls(key)

    def admits(self, header: str | None) -> bool:
        """Whether ``header`` (the request's Authorization, None when absent) gives the key.
        The comparison takes the same time wherever the two differ."""
        if header is None:
            return False
        try:
            return hmac.compare_digest(header, self._expected)
        except TypeError:  # a header with non-ASCII characters (Starlette reads them as latin-1)
            return False

    async def check(self, request: Request) -> None:
        """A FastAPI dependency (a coroutine, so that it runs on the event loop rather than
        in a thread): raises :class:`Unauthorized` unless the request gives the key."""
        if not self.admits(request.headers.get("authorization")):
            raise Unauthorized()


def key_dependencies(key: ApiKey | None) -> list:
    """The dependencies of a data-plane route: the key's check, or none without a key."""
    return [] if key is None else [Depends(key.check)]
