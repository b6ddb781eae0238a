"""HTTP/1.1 connections held to deadlines and sizes: uvicorn's h11 protocol, plus a
deadline for a request's headers and one for its body, a limit on the headers' size
(431) and on the number of open connections (503). Runs in the server's process, on
the event loop; :func:`protocol_class` makes the class that ``uvicorn.Config(http=...)``
takes (``serve.uvicorn_config``).

# NOTE [Connection limits]
uvicorn never times out a connection that sends nothing, or a byte a second, and
accepts headers of any size a read can bring. Here, per connection:
- headers: from the connection's start, or the end of its previous answer, the request
  line and headers must arrive within ``server.header_timeout_s``. On expiry the
  connection is closed, with 408 when part of a request had come. Between requests
  uvicorn's keep-alive timeout (5 s) also closes an idle connection; a byte that comes
  in time no longer resets anything, so trickling does not help.
- body: the whole body must arrive within ``server.body_timeout_s`` of the headers;
  else 408 and close. The application sees the client disconnect.
- size: a request line plus headers over ``server.max_header_bytes`` gets 431 and the
  connection is closed: h11 refuses an incomplete head that outgrows its buffer
  (``max_incomplete_event_size``), and a complete head that came in one read is
  measured here.
- count: a connection that finds ``server.max_connections`` open gets 503 at once; it
  is read from (and the bytes dropped) for up to a second, so that its request does not
  meet a reset before the client reads the answer, then closed.

What this relies on in uvicorn (checked against 0.54; the tests in
``tests/integration/test_server_hostile.py`` fail if any of it changes):
- ``H11Protocol(config, server_state, app_state, _loop)`` keeps its ``h11.Connection``
  in ``self.conn`` and reads events with ``self.conn.next_event()`` in
  ``handle_events``, answering ``h11.RemoteProtocolError`` with ``send_400_response``;
- the asyncio callbacks ``connection_made``, ``data_received``, ``connection_lost``,
  and ``on_response_complete`` (called when an answer is sent), which starts the next
  request's cycle;
- ``self.transport``, ``self.loop`` and ``self.connections`` (the server's set of open
  connections, this one included once ``connection_made`` ran).
"""

from __future__ import annotations

import asyncio
import http
import json
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from timeshare.config import ServerConfig

LINGER_S = 1.0  # how long a refused connection is read from before it is closed


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int
    max_connections: int

    @classmethod
    def from_config(cls, server: ServerConfig) -> ConnectionLimits:
        return cls(server.header_timeout_s, server.body_timeout_s, int(server.max_header_bytes),
                   server.max_connections)


def protocol_class(limits: ConnectionLimits) -> type[LimitedH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, bound to ``limits``."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})


def head_size(event: h11.Request) -> int:
    """The size of a request line and headers as sent (give or take their spacing)."""
    return (len(event.method) + len(event.target) + 12
            + sum(len(name) + len(value) + 4 for name, value in event.headers.raw_items()))


class _Connection(h11.Connection):
    """h11's server side that also refuses a complete request head over
    ``max_header_bytes``, as h11 refuses an incomplete one that outgrows its buffer: with
    a ``RemoteProtocolError`` whose status hint is 431. The last refusal is kept, for the
    answer."""

    def __init__(self, max_header_bytes: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes = max_header_bytes
        self.refusal: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refusal = exc
            raise
        if isinstance(event, h11.Request) and (size := head_size(event)) > self.max_header_bytes:
            self.refusal = h11.RemoteProtocolError(
                f"request line and headers of {size} bytes are over the limit of {self.max_header_bytes} "
                "(server.max_header_bytes)", error_status_hint=431)
            raise self.refusal
        return event


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under NOTE [Connection limits]. Use :func:`protocol_class`."""

    limits: ConnectionLimits  # set on the class by protocol_class
    conn: _Connection  # h11's connection, with the head limit

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(self.limits.max_header_bytes)
        self._timer: asyncio.TimerHandle | None = None  # the running deadline (or linger)
        self._phase: str | None = None  # "head" or "body" while a deadline runs
        self._partial = False  # part of a request came during the "head" phase
        self._refused = False

    # ------------------------------------------------------------------ asyncio callbacks
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse()
        else:
            self._track()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped until the linger ends
        if self._phase == "head":
            self._partial = True
        super().data_received(data)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next request's cycle (and read it)
        self._track()

    # ------------------------------------------------------------------ answers
    def send_400_response(self, msg: str) -> None:
        """h11 refused the request: 431 for a head over the limit, else 400; as JSON."""
        refusal = self.conn.refusal
        status = refusal.error_status_hint if refusal is not None else 400
        self._answer_and_close(status, str(refusal) if status == 431 else msg)

    def _answer_and_close(self, status: int, message: str) -> None:
        self._answer(status, message)
        self.transport.close()

    def _answer(self, status: int, message: str, *, retry_after: bool = False) -> None:
        body = json.dumps({"error": message}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")] + ([(b"retry-after", b"1")] if retry_after else [])
        try:
            for event in (h11.Response(status_code=status, reason=http.HTTPStatus(status).phrase.encode(),
                                       headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            pass  # an answer had started: the close says the rest

    def _refuse(self) -> None:
        """Over ``max_connections``: 503 at once, then read and drop what comes for
        LINGER_S (so the request finds no reset before its client reads the answer), then close."""
        self._refused = True
        self._answer(503, f"the server has {self.limits.max_connections} connections open "
                          "(server.max_connections); retry later", retry_after=True)
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)

    # ------------------------------------------------------------------ deadlines
    def _track(self) -> None:
        """Start, keep or stop the deadline for where the request now is."""
        if self._refused or self.transport.is_closing():
            return
        state = self.conn.their_state
        phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase != self._phase:
            self._partial = False
            self._set_deadline(phase)

    def _set_deadline(self, phase: str | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = phase
        if phase is not None:
            seconds = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
            self._timer = self.loop.call_later(seconds, self._expire, phase)

    def _expire(self, phase: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if phase == "body":
            self._answer_and_close(408, f"the request body did not arrive within {self.limits.body_timeout_s} s "
                                        "(server.body_timeout_s)")
        elif self._partial:
            self._answer_and_close(408, f"the request headers did not arrive within {self.limits.header_timeout_s} "
                                        "s (server.header_timeout_s)")
        else:  # nothing to answer: an idle connection just goes
            self.transport.close()
