"""``timeshare.yaml``: the one file that describes a server: the runtime (device, memory
budget, workers, scheduling, eviction), the HTTP server (ports, limits), the admin plane
(who may use it), the models and the training jobs. Runs in the server's process.

Validated by pydantic at load time; every error names the field, as a path
("models[1].max_batch"), and the value it got. Unknown fields are errors, so a typo
never silently falls back to a default. ``timeshare serve --print-default-config``
shows every field with its default.

The sections, one module each: ``runtime``, ``server`` (with ``admin``), ``cluster``,
``workloads`` (models, language models, training jobs); ``fields`` holds what they are
built from, ``document`` the whole file and its loading.
"""

from timeshare.config.cluster import ClusterConfig
from timeshare.config.document import DEFAULT_CONFIG, Config, load_config, parse_config
from timeshare.config.fields import DATATYPES
from timeshare.config.runtime import RuntimeConfig
from timeshare.config.server import AdminConfig, ServerConfig
from timeshare.config.workloads import AdapterConfig, LLMConfig, ModelConfig, TensorSpec, TrainingConfig

__all__ = [
    "DATATYPES", "DEFAULT_CONFIG", "AdapterConfig", "AdminConfig", "ClusterConfig", "Config", "LLMConfig",
    "ModelConfig", "RuntimeConfig", "ServerConfig", "TensorSpec", "TrainingConfig", "load_config", "parse_config",
]
