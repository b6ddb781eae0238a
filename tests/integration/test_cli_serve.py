"""The serving commands of the CLI: config errors, the demo (on a small config) and
the model listing."""

from __future__ import annotations

import json

import pytest
import yaml

from timeshare import cli


def test_serve_check_prints_the_validated_config(tmp_path, capsys):
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "zoo": "tiny_mlp"}]}))
    assert cli.main(["serve", "--config", str(path), "--port", "9123", "--metrics-port", "none", "--check"]) == 0
    checked = yaml.safe_load(capsys.readouterr().out)
    assert checked["server"]["http_port"] == 9123 and checked["server"]["metrics_port"] is None
    assert checked["models"][0]["max_batch"] == 8


def test_serve_check_does_not_print_secrets(tmp_path, capsys):
    path = tmp_path / "secret.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "zoo": "tiny_mlp"}], "admin": {"token": "admin-t0ken"}}))
    assert cli.main(["serve", "--config", str(path), "--api-key", "k3y-value", "--check"]) == 0
    out = capsys.readouterr().out
    assert "k3y-value" not in out and "admin-t0ken" not in out
    checked = yaml.safe_load(out)
    assert checked["server"]["api_key"] == checked["admin"]["token"] == "(set, not shown)"


@pytest.mark.parametrize("text, words", [
    ("runtime:\n  memroy: 4GiB\n", "runtime.memroy: unknown field"),
    ("models:\n  - name: a\n    zoo: resnet\n", "unknown zoo model 'resnet'"),
    ("server:\n  http_port: 99999\n", "server.http_port"),
    ("runtime: [\n", "line 2"),
])
def test_serve_names_the_bad_field(tmp_path, capsys, text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert cli.main(["serve", "--config", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert words in err


def test_default_config_and_models_listing(capsys):
    assert cli.main(["serve", "--print-default-config"]) == 0
    default = yaml.safe_load(capsys.readouterr().out)
    assert [m["zoo"] for m in default["models"]] == ["resnet152", "inception_v3", "bert_base"]
    assert default["training"][0]["model"] == "tiny_cnn"
    assert cli.main(["models"]) == 0
    assert "input_ids, attention_mask" in capsys.readouterr().out


def test_demo_on_a_small_config(tmp_path, capsys):
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump({
        "runtime": {"device": "cpu", "memory": 1_600_000},  # the 1.4 MB chat model and tiny_bert switch
        "models": [{"name": "mlp", "zoo": "tiny_mlp"}, {"name": "bert", "zoo": "tiny_bert"},
                   {"name": "cnn", "zoo": "tiny_cnn"}],
        "training": [{"name": "bg", "model": "tiny_cnn", "batch": 4}],
    }))
    out = tmp_path / "out"
    code = cli.main(["demo", "--config", str(config), "--duration", "4", "--phase", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    s = json.loads((out / "demo.json").read_text())["summary"]
    assert s["answered"] == s["requests"] > 10 and s["errors"] == 0
    assert s["server_exit_code"] == 0 and s["server_leftover_processes"] == 0
    assert s["switches"] > 0 and s["loads"] > 0 and 0 < s["device_utilization"] <= 1.05
    assert set(s["per_model"]) == {"mlp", "bert", "cnn"}
    chat = s["chat"]  # streamed chats through the OpenAI API, each text equal to transformers' generate
    assert chat["requests"] >= 2 and chat["answered"] == chat["requests"] and chat["mismatched"] == 0
    assert chat["tokens"] > 0 and chat["ttft_p50_ms"] > 0
    assert (out / "demo.png").read_bytes()[:4] == b"\x89PNG"
    assert "switches" in printed and "p99 ms" in printed
