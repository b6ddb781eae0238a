import json

from timeshare import cli


def test_bench_pipeline_writes_json_with_exact_outputs(tmp_path, capsys):
    path = tmp_path / "out" / "bench.json"
    code = cli.main(
        ["bench", "pipeline", "--models", "tiny_cnn", "tied_lm", "--batch", "2", "--repeats", "2",
         "--device", "cpu", "--memory", "16MiB", "--json", str(path)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "tiny_cnn" in printed and "tied_lm" in printed and "First-inference latency" in printed
    data = json.loads(path.read_text())
    assert data["benchmark"] == "pipeline"
    assert data["environment"]["torch"] and data["environment"]["device"] == "cpu"
    assert [r["model"] for r in data["results"]] == ["tiny_cnn", "tied_lm"]
    for r in data["results"]:
        assert r["outputs_match_ready"] is True
        assert set(r["strategies"]) == {"optimal", "per_layer", "whole", "fixed"}
        assert r["floor_ms"] >= r["transfer_ms"] > 0 and r["ready_ms"] > 0
        for s in r["strategies"].values():
            assert s["ms"] > 0 and s["groups"] >= 1


def test_unknown_model_is_a_clear_error(capsys):
    assert cli.main(["bench", "pipeline", "--models", "gpt9", "--device", "cpu"]) == 2
    assert "unknown zoo model 'gpt9'" in capsys.readouterr().err


def test_bad_numbers_and_devices_are_refused(capsys):
    assert cli.main(["bench", "pipeline", "--models", "tiny_mlp", "--batch", "0"]) == 2
    assert "--batch" in capsys.readouterr().err
    assert cli.main(["bench", "pipeline", "--models", "tiny_mlp", "--device", "tpu"]) == 2
    assert "device must be one of" in capsys.readouterr().err


def test_zoo_lists_models(capsys):
    assert cli.main(["zoo"]) == 0
    out = capsys.readouterr().out
    assert "resnet152" in out and "60,192,808" in out
