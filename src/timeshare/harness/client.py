"""A small Open Inference Protocol client over httpx, for the demo, ``bench serve`` and
the tests: tensors go out and come back with the binary tensor data extension (no JSON
lists of floats on either side). Any process; thread-safe (one ``httpx.Client``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import torch

from timeshare.dtypes import DATATYPES, TORCH_DTYPES
from timeshare.server.tensors import from_binary, to_binary


@dataclass
class Answer:
    status: int
    outputs: dict[str, torch.Tensor]
    parameters: dict
    id: str | None = None
    error: str | None = None
    retry_after: str | None = None


class Client:
    def __init__(self, url: str, *, timeout_s: float = 120.0, token: str | None = None):
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ready(self) -> bool:
        try:
            return self.http.get("/v2/health/ready").status_code == 200
        except httpx.TransportError:
            return False

    def metadata(self, model: str) -> dict:
        r = self.http.get(f"/v2/models/{model}")
        r.raise_for_status()
        return r.json()

    def infer(self, model: str, inputs: dict[str, torch.Tensor], *, request_id: str | None = None) -> Answer:
        header: dict = {"inputs": [], "parameters": {"binary_data_output": True}}
        if request_id is not None:
            header["id"] = request_id
        blobs = []
        for name, t in inputs.items():
            raw = to_binary(t)
            header["inputs"].append({"name": name, "shape": list(t.shape), "datatype": DATATYPES[t.dtype],
                                     "parameters": {"binary_data_size": len(raw)}})
            blobs.append(raw)
        head = json.dumps(header).encode()
        r = self.http.post(f"/v2/models/{model}/infer", content=head + b"".join(blobs),
                           headers={"Inference-Header-Content-Length": str(len(head)),
                                    "Content-Type": "application/octet-stream"})
        return decode_answer(r)

    def metrics_text(self) -> str:
        r = self.http.get("/metrics")
        r.raise_for_status()
        return r.text


def decode_answer(r: httpx.Response) -> Answer:
    if r.status_code != 200:
        try:
            message = r.json().get("error", r.text)
        except ValueError:
            message = r.text
        return Answer(r.status_code, {}, {}, error=message, retry_after=r.headers.get("retry-after"))
    n = r.headers.get("inference-header-content-length")
    body = r.content
    head = json.loads(body[: int(n)] if n is not None else body)
    offset, outputs = int(n) if n is not None else 0, {}
    for o in head["outputs"]:
        size = (o.get("parameters") or {}).get("binary_data_size")
        if size is None:
            outputs[o["name"]] = torch.tensor(o["data"], dtype=TORCH_DTYPES[o["datatype"]]).reshape(o["shape"])
        else:
            outputs[o["name"]] = from_binary(o["name"], o["datatype"], o["shape"], body[offset:offset + size],
                                                  finite=False)
            offset += size
    return Answer(200, outputs, head.get("parameters") or {}, id=head.get("id"))
