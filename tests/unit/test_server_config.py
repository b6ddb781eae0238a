"""The server section's defaults and the data plane's key as the config and the command
line give it (issue 34, item 4): loopback unless told otherwise, the key from the file,
the environment or ``--api-key``, checked without ever showing it."""

from __future__ import annotations

import pytest
import yaml

from timeshare import cli
from timeshare.config import DEFAULT_CONFIG, ServerConfig, load_config, parse_config
from timeshare.errors import ConfigError
from timeshare.server.auth import ApiKey
from timeshare.server.llms import llm_def


def test_the_server_listens_on_loopback_unless_told_otherwise(monkeypatch):
    assert ServerConfig().host == "127.0.0.1"
    assert parse_config({}).server.host == "127.0.0.1"
    assert load_config(DEFAULT_CONFIG).server.host == "127.0.0.1"
    assert parse_config({"server": {"host": "0.0.0.0"}}).server.host == "0.0.0.0"
    monkeypatch.delenv("TIMESHARE_API_KEY", raising=False)
    assert parse_config({}).server.resolved_api_key() is None  # and the data plane is open


def test_the_key_comes_from_the_file_else_the_environment(monkeypatch):
    monkeypatch.setenv("TIMESHARE_API_KEY", "from-env")
    assert parse_config({}).server.resolved_api_key() == "from-env"
    assert parse_config({"server": {"api_key": "from-file"}}).server.resolved_api_key() == "from-file"
    assert parse_config({"server": {"api_key_env": None}}).server.resolved_api_key() is None
    monkeypatch.setenv("TIMESHARE_API_KEY", "")  # an empty variable is no key, as for the admin token
    assert parse_config({}).server.resolved_api_key() is None


@pytest.mark.parametrize("key, words", [
    ("", "server.api_key: api_key must not be empty"),
    ("two words", "server.api_key: api_key must be printable ASCII without spaces (it is sent in an HTTP header); "
                  "1 of its 9 characters are not"),
    ("caf\u00e9-\u00e9", "2 of its 6 characters are not"),
    ("line\nbreak", "1 of its 10 characters are not"),
])
def test_a_key_no_client_can_send_is_refused_without_showing_it(key, words):
    with pytest.raises(ConfigError) as err:
        parse_config({"server": {"api_key": key}})
    assert words in str(err.value)
    assert "Value error" not in str(err.value)
    if key:
        assert key not in str(err.value) and repr(key) not in str(err.value)


def test_a_bad_key_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("TIMESHARE_API_KEY", "has space")
    with pytest.raises(ConfigError, match=r"^\$TIMESHARE_API_KEY must be printable ASCII") as err:
        parse_config({}).server.resolved_api_key()
    assert "has space" not in str(err.value)


def test_the_api_key_flag_overrides_the_file(tmp_path, capsys, monkeypatch):
    from timeshare.cli.serve import load_with_overrides

    monkeypatch.delenv("TIMESHARE_API_KEY", raising=False)
    path = tmp_path / "keyed.yaml"
    path.write_text(yaml.safe_dump({"server": {"api_key": "from-file"}}))

    def server(*flags: str) -> ServerConfig:
        return load_with_overrides(cli._parser().parse_args(["serve", "--config", str(path), *flags])).server

    assert server().api_key == "from-file" and server().host == "127.0.0.1"
    flagged = server("--api-key", "from-flag", "--host", "0.0.0.0")
    assert flagged.api_key == "from-flag" and flagged.resolved_api_key() == "from-flag" and flagged.host == "0.0.0.0"
    with pytest.raises(ConfigError, match="server.api_key: api_key must be printable ASCII"):
        server("--api-key", "bad key")
    assert cli.main(["serve", "--config", str(path), "--api-key", "bad key"]) == 2  # named, before anything starts
    assert "server.api_key" in capsys.readouterr().err


def test_the_key_is_compared_whole():
    key = ApiKey("k-123")
    assert key.admits("Bearer k-123")
    for header in (None, "", "k-123", "Bearer k-12", "Bearer k-1234", "bearer k-123", "Bearer  k-123",
                   "Bearer k-123 ", "Bearer k-\u00e9\u00e9\u00e9", "Basic k-123"):
        assert not key.admits(header), header
    assert ApiKey.of(None) is None and ApiKey.of("x") is not None


def test_decode_graphs_and_compile_reach_the_language_models_load(tmp_path, monkeypatch):
    """vLLM's enforce_eager as ``decode_graphs: false``; ``compile: false`` captures the eager
    step (NOTE [Compiled decode steps]); both on by default."""
    from timeshare.llm import model as lm
    from timeshare.server import llms

    (tmp_path / "config.json").write_text('{"vocab_size": 32}')
    seen: list[dict] = []
    monkeypatch.setattr(lm, "load", lambda *a, **k: seen.append(k))
    base = {"name": "m", "path": str(tmp_path)}
    for entry, want in (({}, ("auto", "auto")), ({"decode_graphs": False}, ("off", "auto")),
                        ({"compile": False}, ("auto", "off"))):
        cfg = parse_config({"llms": [{**base, **entry}]}).llms[0]
        llms.open_local(None, cfg)  # type: ignore[arg-type]
        assert (seen[-1]["graphs"], seen[-1]["compile"]) == want
    with pytest.raises(ConfigError, match="compile"):
        parse_config({"llms": [{**base, "compile": "max-autotune"}]})


def test_lora_flags_reach_the_language_models_entries(tmp_path):
    """``--lora NAME=DIR`` (vLLM's ``--lora-modules`` and its JSON form too), ``--max-loras``,
    ``--max-lora-rank`` and ``--lora-dir`` (NOTE [Adapter residency])."""
    import json

    from timeshare.cli.serve import load_with_overrides

    for name in ("m", "n"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"vocab_size": 32}')
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")

    def llms(entries: list[str], *flags: str):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({"llms": [{"name": n, "path": str(tmp_path / n)} for n in entries]}))
        return load_with_overrides(cli._parser().parse_args(["serve", "--config", str(path), *flags])).llms

    one = llms(["m"], "--lora", f"a={tmp_path / 'a'}", "--lora-modules", f"b={tmp_path / 'b'}", "--max-loras", "3",
               "--max-lora-rank", "16", "--lora-dir", str(tmp_path), "--max-cpu-loras", "5")[0]
    assert [(a.name, a.path) for a in one.adapters] == [("a", str(tmp_path / "a")), ("b", str(tmp_path / "b"))]
    assert (one.max_loras, one.max_lora_rank, one.lora_dir) == (3, 16, str(tmp_path))
    assert one.max_cpu_loras == 5 and llm_def(one).max_cpu_loras == 5 and llm_def(one).serves_adapters
    with pytest.raises(ConfigError, match=r"max_cpu_loras \(2\) must be at least max_loras \(8\)"):
        llms(["m"], "--max-cpu-loras", "2")  # against the default 8 slots, before anything loads
    pinned = tmp_path / "p.yaml"  # a pinned adapter is pinned as it is added, before any bound lets it go
    pinned.write_text(yaml.safe_dump({"llms": [{"name": "m", "path": str(tmp_path / "m"), "adapters": [
        {"name": "a", "path": str(tmp_path / "a"), "pinned": True}, {"name": "b", "path": str(tmp_path / "b")}]}]}))
    entry = load_with_overrides(cli._parser().parse_args(["serve", "--config", str(pinned)])).llms[0]
    assert llm_def(entry).adapters == (("a", str(tmp_path / "a"), True), ("b", str(tmp_path / "b"), False))
    two = llms(["m", "n"], "--lora", json.dumps({"name": "a", "path": str(tmp_path / "a"), "base_model_name": "n"}))
    assert [e.adapters for e in two][0] == [] and [a.name for a in two[1].adapters] == ["a"]
    assert not llm_def(two[0]).serves_adapters
    for flags, words in ((["--lora", f"a={tmp_path / 'a'}"], "base_model_name"),
                         (["--lora", "a"], "give NAME=DIR"),
                         (["--lora", '{"name": "a"}'], "the JSON form"),
                         (["--lora", json.dumps({"name": "a", "path": str(tmp_path), "base_model_name": "x"})],
                          "not a language model served")):
        with pytest.raises(ConfigError, match=words):
            llms(["m", "n"], *flags)
    with pytest.raises(ConfigError, match="not an adapter directory"):
        llms(["m"], "--lora", f"a={tmp_path / 'm'}")
