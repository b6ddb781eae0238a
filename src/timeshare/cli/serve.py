"""``timeshare serve``: argument parsing, the config with the command line's overrides,
and ``--check``. Runs in the CLI's process.

    timeshare serve [MODEL ...] [--config timeshare.yaml] [--host H] [--port N] [--metrics-port N|none] [--check]
                    [--lora NAME=DIR ...] [--max-loras N] [--max-lora-rank N] [--lora-dir DIR]
                    [--max-cpu-loras N]
"""

from __future__ import annotations

from pathlib import Path

from timeshare.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve models over HTTP (Open Inference Protocol v2) from a YAML config",
        description="Start the runtime and an HTTP server: the Open Inference Protocol (KServe v2) data plane "
        "on --port, Triton's model repository extension and timeshare's admin plane (loopback only unless a "
        "token is set), Prometheus /metrics on both --port and --metrics-port. Ctrl-C or SIGTERM drains "
        "in-flight requests, then stops every worker process. Without --config: the embedded default.")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="a Hugging Face model directory, a repository id in the local Hugging Face cache "
                   "(org/model; nothing is downloaded) or, with --build and --input, a safetensors file: served "
                   "beside the config's models (without --config, alone)")
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="the name each MODEL is served as, in order (default: its directory's name or its id)")
    p.add_argument("--build", default=None, metavar="MODULE:FUNCTION", help="the builder of a weights file MODEL")
    p.add_argument("--input", action="append", default=None, metavar="NAME:DATATYPE:SHAPE",
                   help="an input of a weights file MODEL, e.g. x:FP32:-1,3,32,32 (-1: any size)")
    p.add_argument("--lora", "--lora-modules", dest="lora", action="extend", nargs="+", default=None,
                   metavar="NAME=DIR",
                   help="a LoRA adapter in PEFT's format, served as NAME (vLLM's --lora-modules spelling too, or "
                   'its JSON form {"name": ..., "path": ..., "base_model_name": ...}); of the one language model '
                   "served, or of base_model_name")
    p.add_argument("--max-loras", type=int, default=None,
                   help="adapters on the device at once (default 8 when adapters are served)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank served (default 64)")
    p.add_argument("--lora-dir", default=None, metavar="DIR",
                   help="a directory of adapter directories: a request naming an adapter not loaded loads DIR/NAME")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters in host memory at most, at least --max-loras (default: no bound); one let go is "
                   "read from its directory again on its next request")
    p.add_argument("--config", type=Path, default=None,
                   help="timeshare.yaml (default: the embedded default, or nothing when MODELs are given)")
    p.add_argument("--host", default=None,
                   help="override server.host (default 127.0.0.1, this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=None, help="override server.http_port")
    p.add_argument("--metrics-port", default=None, help="override server.metrics_port ('none': no metrics port)")
    p.add_argument("--device", default=None, help="override runtime.device")
    p.add_argument("--memory", default=None, help="override runtime.memory, e.g. 4GiB")
    p.add_argument("--workers", type=int, default=None, help="override runtime.workers")
    p.add_argument("--api-key", default=None, help="override server.api_key: /v1 and /v2 (but health) then need "
                   "'Authorization: Bearer KEY' (default: $TIMESHARE_API_KEY, else open)")
    p.add_argument("--check", action="store_true",
                   help="validate the config and print it, then check every model (builder imported, module built, "
                   "weights headers matched against it) and exit: 1 if a model that is not optional fails, each named")
    p.add_argument("--exit-on-error", action="store_true",
                   help="exit with status 1 once start-up ends if a model that is not optional failed for good "
                   "(server.exit_on_error)")
    p.add_argument("--print-default-config", action="store_true", help="print the embedded default config and exit")


def run(args, console) -> int:
    return _serve(args, console)


def load_with_overrides(args):
    from timeshare.config import DEFAULT_CONFIG, load_config, parse_config

    given = getattr(args, "models", None) or []
    source = args.config or (None if given else DEFAULT_CONFIG)
    doc = {} if source is None else load_config(source).model_dump()
    doc.setdefault("server", {}), doc.setdefault("runtime", {})
    _add_models(doc, given, args)
    _add_adapters(doc, args)
    server, runtime = doc["server"], doc["runtime"]
    for key, value in (("host", args.host), ("http_port", args.port), ("api_key", args.api_key)):
        if value is not None:
            server[key] = value
    if args.metrics_port is not None:
        server["metrics_port"] = None if args.metrics_port.lower() == "none" else _int(args.metrics_port)
    for key, value in (("device", args.device), ("memory", args.memory), ("workers", args.workers)):
        if value is not None:
            runtime[key] = value
    return parse_config(doc, f"{source or 'the command line'} with command-line overrides")


def _add_models(doc: dict, given: list[str], args) -> None:
    """The MODEL arguments as ``llms`` or ``models`` entries of the config document."""
    from timeshare.config.sources import section, tensor_spec
    from timeshare.config.workloads import ModelConfig

    names = args.served_model_name or []
    if len(names) > len(given):
        raise ConfigError(f"--served-model-name given {len(names)} times for {len(given)} MODEL arguments")
    inputs = [tensor_spec(t) for t in args.input or []]
    for i, arg in enumerate(given):
        entry = section(arg, name=names[i] if i < len(names) else None, build=args.build, inputs=inputs)
        key = "models" if isinstance(entry, ModelConfig) else "llms"
        doc.setdefault(key, []).append(entry.model_dump(exclude_defaults=True))


def _add_adapters(doc: dict, args) -> None:
    """``--lora``, ``--max-loras``, ``--max-lora-rank``, ``--lora-dir`` and
    ``--max-cpu-loras`` on the ``llms`` entries of the config document (NOTE [Adapter
    residency])."""
    import json

    loras = getattr(args, "lora", None) or []
    options = {k: v for k, v in (("max_loras", getattr(args, "max_loras", None)),
                                 ("max_lora_rank", getattr(args, "max_lora_rank", None)),
                                 ("lora_dir", getattr(args, "lora_dir", None)),
                                 ("max_cpu_loras", getattr(args, "max_cpu_loras", None))) if v is not None}
    if not loras and not options:
        return
    llms = doc.get("llms") or []
    by_name = {entry["name"]: entry for entry in llms}

    def base_of(name: str | None) -> dict:
        if name is not None:
            if name not in by_name:
                raise ConfigError(f"--lora names base_model_name {name!r}, which is not a language model served")
            return by_name[name]
        if len(llms) != 1:
            raise ConfigError(f"--lora needs one language model to adapt, or base_model_name, with {len(llms)} served")
        return llms[0]

    for text in loras:
        if text.lstrip().startswith("{"):
            try:
                given = json.loads(text)
                name, path, base = given["name"], given["path"], given.get("base_model_name")
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f'--lora {text!r}: the JSON form is {{"name": ..., "path": ..., '
                                  '"base_model_name": optional}') from None
        else:
            name, sep, path = text.partition("=")
            base = None
            if not sep or not name or not path:
                raise ConfigError(f"--lora {text!r}: give NAME=DIR")
        base_of(base).setdefault("adapters", []).append({"name": name, "path": path})
    for entry in llms if not loras else {id(e): e for e in llms if "adapters" in e}.values():
        entry.update(options)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--metrics-port must be a port number or 'none', got {text!r}") from None


def _serve(args, console) -> int:
    import yaml

    from timeshare.config import DEFAULT_CONFIG

    if args.print_default_config:
        console.print(DEFAULT_CONFIG.read_text(), markup=False, highlight=False, end="")
        return 0
    config = load_with_overrides(args)
    if args.exit_on_error:
        config = config.model_copy(update={"server": config.server.model_copy(update={"exit_on_error": True})})
    if args.check:
        shown = config.model_dump()
        for section, key in (("server", "api_key"), ("admin", "token")):  # a secret is not printed
            if shown[section].get(key) is not None:
                shown[section][key] = "(set, not shown)"
        console.print(yaml.safe_dump(shown, sort_keys=False), markup=False, highlight=False, end="")
        return _check(config)
    import logging

    logging.getLogger("timeshare").setLevel(logging.INFO)
    from timeshare.server import serve

    s = config.server
    c = config.cluster
    where = config.runtime.device if c is None else (
        f"a cluster of {c.replicas} {config.runtime.device} replicas on Ray "
        f"({'a local one' if c.address is None else c.address})")
    llms = f", {len(config.llms)} language models ({', '.join(m.name for m in config.llms)}; " \
        f"http://{s.host}:{s.http_port}/v1)" if config.llms else ""
    console.print(f"timeshare serve: {len(config.models)} models, {len(config.training)} training jobs{llms} on "
                  f"{where}; http://{s.host}:{s.http_port}/v2"
                  + (f", metrics on :{s.metrics_port}" if s.metrics_port is not None else ""), markup=False)
    return serve(config)


def _check(config) -> int:
    """``--check``'s models (``server/check.py``): one line each on stderr, stdout keeping
    the validated config; status 1 when a model that is not optional failed."""
    from rich.console import Console

    from timeshare.server.check import check_config

    report = check_config(config)
    err = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)
    for c in report.checks:
        verdict = "ok" if c.ok else "FAILED (optional)" if c.optional else "FAILED"
        err.print(f"{verdict}: {c.kind} {c.name!r}: {c.detail if c.ok else c.problem}")
    if report.failed:
        err.print(f"{len(report.failed)} of {len(report.checks)} models cannot serve: "
                  + ", ".join(repr(c.name) for c in report.failed))
        return 1
    return 0


