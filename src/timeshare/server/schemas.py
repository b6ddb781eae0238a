"""Request bodies of the Open Inference Protocol (v2) and of the admin plane, as
pydantic models. Strict: unknown fields and wrong JSON types are refused with the
field's path. Runs in the server's process."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from timeshare.config import TrainingConfig

# Parameter values are scalars (the protocol's "$parameter": bool, number or string).
Parameters = dict[StrictStr, StrictBool | StrictInt | float | StrictStr]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RequestInput(_Body):
    name: StrictStr
    shape: list[StrictInt] = Field(max_length=16)
    datatype: StrictStr
    parameters: Parameters | None = None
    data: list[Any] | None = None  # checked against datatype and shape in ``tensors.from_json``


class RequestOutput(_Body):
    name: StrictStr
    parameters: Parameters | None = None


class InferenceRequest(_Body):
    id: StrictStr | None = None
    parameters: Parameters | None = None
    inputs: list[RequestInput] = Field(min_length=1, max_length=64)
    outputs: list[RequestOutput] | None = None


class RepositoryIndexRequest(_Body):
    ready: StrictBool = False


class TrainingRequest(TrainingConfig):
    """A training job to start: the same fields as a ``training:`` entry of the config."""
