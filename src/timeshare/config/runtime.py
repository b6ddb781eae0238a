"""The ``runtime`` section of ``timeshare.yaml``: ``timeshare.Runtime``'s options
(``timeshare.options.RuntimeOptions``, defined and documented there once), and the
language models' budget for caches, which the server applies. Runs in the server's
process.
"""

from __future__ import annotations

from pydantic import field_validator

from timeshare.config.fields import bytes_field
from timeshare.options import RuntimeOptions


class RuntimeConfig(RuntimeOptions):
    """How the device is shared: the runtime's options, and the caches' budget."""

    kv_memory: int | str | None = None
    """With ``llms``: how many bytes of the device the key/value caches of language models
    may keep there between their turns; beyond it, the caches of the models that ran least
    recently move to host memory until their next turn. Null: they all stay."""

    def options(self, default_task_timeout_s: float) -> RuntimeOptions:
        """The runtime's options of this section; a task's deadline defaults to
        ``default_task_timeout_s`` (the server's request timeout)."""
        return RuntimeOptions.of(self, task_timeout_s=self.task_timeout_s or default_task_timeout_s)

    @field_validator("kv_memory", mode="before")
    @classmethod
    def _kv_memory(cls, value):
        if value is not None:
            bytes_field(value, "kv_memory")
        return value
