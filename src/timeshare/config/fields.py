"""What every section of ``timeshare.yaml`` is built from: a strict pydantic model (unknown
fields are errors, values frozen, defaults validated), the check of a name that appears
in URLs, byte sizes with units, and the protocol's datatypes. Runs in the server's
process (and the command line's).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from timeshare.dtypes import DATATYPE_NAMES
from timeshare.errors import ConfigError
from timeshare.units import parse_bytes

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # safe in a URL path segment

# The Open Inference Protocol's tensor datatypes that models here can take or return.
DATATYPES = DATATYPE_NAMES


class Strict(BaseModel):
    """A section: unknown fields are errors (a typo never falls back to a default), values
    are frozen, and defaults are validated too."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def valid_name(value: str, what: str) -> str:
    """``value`` if it is a name safe in a URL path segment; else a message naming ``what``."""
    if not _NAME.match(value):
        raise ValueError(f"{what} {value!r} must be 1-64 letters, digits, '_', '.' or '-', starting with a "
                         "letter or digit")
    return value


def bytes_field(value: Any, what: str) -> int:
    """A byte size given as a number or with a unit ("64MiB"), as pydantic's error on failure."""
    try:
        return parse_bytes(value, what=what)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
