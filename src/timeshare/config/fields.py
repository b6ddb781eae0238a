"""What every section of ``timeshare.yaml`` is built from: a strict pydantic model (unknown
fields are errors, values frozen, defaults validated), the check of a name that appears
in URLs, byte sizes with units, and the protocol's datatypes. Runs in the server's
process (and the command line's).
"""

from __future__ import annotations

import re

from timeshare.dtypes import DATATYPE_NAMES
from timeshare.options import Strict, bytes_field

__all__ = ["DATATYPES", "Strict", "bytes_field", "valid_name"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # safe in a URL path segment

# The Open Inference Protocol's tensor datatypes that models here can take or return.
DATATYPES = DATATYPE_NAMES


def valid_name(value: str, what: str) -> str:
    """``value`` if it is a name safe in a URL path segment; else a message naming ``what``."""
    if not _NAME.match(value):
        raise ValueError(f"{what} {value!r} must be 1-64 letters, digits, '_', '.' or '-', starting with a "
                         "letter or digit")
    return value
