import json
import os

import torch

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
        assert set(r["strategies"]) - {"optimal+direct"} == {"optimal", "per_layer", "whole", "fixed"}
        assert r["floor_ms"] >= r["transfer_ms"] > 0 and r["ready_ms"] > 0
        assert r["native_ms"] > 0 and r["native_matches_ready"] is True  # plain PyTorch computes the same bits
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


def test_bench_switch_measures_every_baseline_with_exact_outputs(tmp_path, capsys):
    path = tmp_path / "switch.json"
    code = cli.main(
        ["bench", "switch", "--models", "tiny_cnn", "--repeats", "2", "--warmup", "1", "--baseline-repeats", "1",
         "--train", "tiny_mlp:8", "--device", "cpu", "--memory", "16MiB", "--json", str(path),
         "--copy-delay-ms", "2"]  # a load that forgot a wait surely reads the poison: exact would be false
    )
    assert code == 0
    assert "First inference after a switch from training" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["benchmark"] == "switch" and data["background_training"]["iterations"] > 0
    (r,) = data["results"]
    assert r["model"] == "tiny_cnn" and r["outputs_match_ready"] is True
    assert r["switches_measured"] == 2  # the job was running at every timed request
    assert len(r["native"]["samples_ms"]) == 2 and r["native_ms"] > 0  # plain PyTorch beside ready, same rounds
    assert all(r["components_ms"][k] is not None and r["components_ms"][k] >= 0 for k in ("stop", "start", "load"))
    for b in ("two_processes", "one_process", "stop_and_start"):
        assert r[f"{b}_ms"] > 0
    assert r["stop_and_start_ms"] > r["timeshare_ms"]
    b = r["ready_breakdown_ms"]  # where a resident call through a worker spends its time
    assert 0 < b["forward"] <= b["worker"] <= b["round_trip"] <= b["call"]
    assert b["pipe_and_pickle"] >= 0 and b["unpickle"] >= 0


def test_bench_cycles_reports_a_fraction_of_ready(tmp_path, capsys):
    path = tmp_path / "cycles.json"
    code = cli.main(
        ["bench", "cycles", "--model", "tiny_cnn", "--cycles", "0.3,0.6", "--rounds", "1", "--min-inference-s", "0.6",
         "--train", "tiny_mlp:8",
         "--device", "cpu", "--memory", "16MiB", "--json", str(path), "--copy-delay-ms", "2"]
    )
    assert code == 0
    assert "Inference throughput time-sharing with training" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["outputs_match_ready"] is True and data["ready_rps"] > 0
    assert [r["cycle_s"] for r in data["results"]] == [0.3, 0.6]
    for r in data["results"]:
        # Each round's first request preempts the running job: one switch per round, exactly.
        assert r["requests"] > 0 and r["switches"] == r["rounds"] and 0 < r["fraction_of_ready"]
    assert [r["rounds"] for r in data["results"]] == [2, 1]


def test_bench_switch_and_cycles_refuse_bad_arguments(capsys):
    assert cli.main(["bench", "switch", "--models", "tiny_cnn", "--train", "nope:3", "--device", "cpu"]) == 2
    assert "unknown zoo model 'nope'" in capsys.readouterr().err
    assert cli.main(["bench", "switch", "--models", "tiny_cnn", "--baselines", "magic", "--device", "cpu"]) == 2
    assert "unknown baseline 'magic'" in capsys.readouterr().err
    assert cli.main(["bench", "cycles", "--model", "tiny_cnn", "--cycles", "1,x"]) == 2
    assert "--cycles" in capsys.readouterr().err


def test_bench_hostile_measures_the_limits_and_the_baseline(tmp_path, capsys):
    out = tmp_path / "hostile.json"
    assert cli.main(["bench", "hostile", "--body-mib", "2", "--idle", "20", "--header-timeout", "1",
                     "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("timeshare bench hostile --body-mib 2")  # every result says how it was made
    r = doc["result"]
    ours, base = r["timeshare"], r["baseline_parse_on_event_loop"]["stall"]
    assert ours["stall"]["body_bytes"] > 2_000_000 and ours["stall"]["small_requests_during"] > 0
    assert base["body_bytes"] == ours["stall"]["body_bytes"] and base["max_stall_ms"] is not None
    assert ours["idle"]["closed"] == 20 and ours["idle"]["last_closed_s"] < 3.0  # by the 1 s header timeout
    assert ours["large_header"]["status"] == 431
    assert ours["admin"]["cross_site_status"] == 403 and ours["admin"]["rebinding_status"] == 403
    assert "bench hostile" in capsys.readouterr().out


def test_bench_lanes_packs_and_time_slices_with_exact_outputs(tmp_path, capsys):
    path, png = tmp_path / "lanes.json", tmp_path / "lanes.png"
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    code = cli.main(["bench", "lanes", "--model", "tiny_cnn", "--counts", "2,3", "--duration", "0.5", "--device", "cpu",
                     "--memory", "16MiB", "--json", str(path), "--plot", str(png), "--train", "tiny_cnn:4",
                     "--train-iterations", "4"])
    assert code == 0
    data = json.loads(path.read_text())
    assert data["outputs_exact"] is True and [r["models"] for r in data["rows"]] == [2, 3]
    for r in data["rows"]:
        assert r["fifo"]["requests"] > 0 and r["pack"]["requests"] > 0 and r["plain_pytorch_req_per_s"] > 0
        assert r["pack"]["lanes_seen"] and not r["fifo"]["lanes_seen"]
    # Under PACK, forwards of different models overlap in time (the timeline's point).
    spans = sorted(data["timeline"], key=lambda s: s["start_s"])
    assert any(b["model"] != a["model"] and b["start_s"] < a["start_s"] + a["seconds"]
               for a, b in zip(spans, spans[1:]))
    assert png.stat().st_size > 0
    # Two jobs packed and time-sliced, each ending with the weights it has alone; alone twice
    # ends with the same weights, so the comparison tests packing (deterministic kernels, the default).
    tr = data["training"]
    assert tr["deterministic"] is True and tr["kernels"]["deterministic_algorithms"] is True
    assert tr["kernels"]["cudnn_deterministic"] is True and tr["kernels"]["cudnn_benchmark"] is False
    cublas = env if env in (":4096:8", ":16:8") else ":4096:8"  # one PyTorch accepts as deterministic is kept
    assert tr["kernels"]["cublas_workspace_config"] == cublas
    for mode in ("fifo", "pack"):
        assert tr[mode]["alone_repeatable"] and tr[mode]["alone_max_abs_diff"] == 0.0, tr[mode]
        assert tr[mode]["equals_alone"] and tr[mode]["max_abs_diff"] == 0.0, tr[mode]
        assert tr[mode]["verdict"].startswith("exact"), tr[mode]
    assert tr["alone_repeatable"] and tr["packed_equals_alone"] and tr["time_sliced_equals_alone"]
    assert tr["pack"]["makespan_s"] > 0 and "deterministic kernels" in tr["comparison"]
    out = " ".join(capsys.readouterr().out.split())  # as printed, less the console's line breaks
    assert "bench lanes" in out and f"CUBLAS_WORKSPACE_CONFIG={cublas}" in out  # under which settings
    assert "alone twice equal: yes; packed = alone: yes; time-sliced = alone: yes" in out
    # The bench gives the process's flags and environment back.
    assert not torch.are_deterministic_algorithms_enabled() and os.environ.get("CUBLAS_WORKSPACE_CONFIG") == env
    assert cli.main(["bench", "lanes", "--counts", "2,x"]) == 2
    assert cli.main(["bench", "lanes", "--counts", "0"]) == 2
    assert cli.main(["bench", "lanes", "--train", "nope:3", "--device", "cpu"]) == 2  # before any model runs


def test_bench_disk_streams_cold_models_from_disk_with_exact_outputs(tmp_path, capsys):
    path = tmp_path / "disk.json"
    code = cli.main(["bench", "disk", "--models", "tiny_cnn", "tied_lm", "--repeats", "1", "--device", "cpu",
                     "--memory", "16MiB", "--json", str(path), "--plot", str(tmp_path / "disk.png")])
    assert code == 0
    assert "bench disk" in capsys.readouterr().out and (tmp_path / "disk.png").stat().st_size > 0
    data = json.loads(path.read_text())
    assert [r["model"] for r in data["rows"]] == ["tiny_cnn", "tied_lm"] and data["command"].startswith("timeshare")
    for r in data["rows"]:
        assert r["bitwise_equal"] is True
        assert r["sequential_read_GBps"] > 0 and r["reader_GBps"] > 0 and r["baseline_first_inference_s"] > 0
        assert r["cold_first_inference_s"] > 0 and r["disk_stage_s"] > 0 and r["floor_s"] > 0
        assert r["store_pinned"] is False  # nothing is page-locked on the CPU (True on CUDA)
    assert cli.main(["bench", "disk", "--models", "gpt9", "--device", "cpu"]) == 2
    assert cli.main(["bench", "disk", "--repeats", "0", "--device", "cpu"]) == 2


def test_bench_variants_holds_the_base_once_and_switches_with_few_bytes(tmp_path, capsys):
    path = tmp_path / "variants.json"
    # A host budget with room for the base and about two variants' own bytes: the variant
    # switched to from disk reads only its own bytes there.
    code = cli.main(["bench", "variants", "--size", "tiny", "--variants", "3", "--repeats", "2", "--device", "cpu",
                     "--memory", "8MiB", "--host-memory", "590KiB", "--json", str(path),
                     "--plot", str(tmp_path / "variants.png")])
    assert code == 0
    assert "bench variants" in capsys.readouterr().out and (tmp_path / "variants.png").stat().st_size > 0
    data = json.loads(path.read_text())
    assert data["outputs_exact"] == data["outputs"] > 0
    b = data["bytes"]
    assert b["shared_sets"] == 1 and b["host"] < 1.2 * b["one_model"] < b["separate_copies"] / 2
    assert data["switch"]["moved_bytes"] < data["full_load"]["moved_bytes"] / 5
    h = data["host_tier"]
    assert h["used"] <= h["budget"] and h["shared_bytes"] == b["shared_bytes"] and h["drops"] >= 2
    assert 0 < h["switch_from_disk"]["moved_bytes"] <= h["switch_from_disk"]["read_bytes"] < b["one_model"] / 5
    assert data["plain_pytorch"]["first_inference_s"] > 0 and data["ready_s"] > 0
    assert cli.main(["bench", "variants", "--variants", "1", "--device", "cpu"]) == 2
    assert cli.main(["bench", "variants", "--host-memory", "lots", "--device", "cpu"]) == 2
    assert "host_memory 'lots' is not a size" in " ".join(capsys.readouterr().err.split())


def test_bench_tiers_serves_models_beyond_host_memory_exactly(tmp_path, capsys):
    path = tmp_path / "tiers.json"
    code = cli.main(["bench", "tiers", "--models", "6", "--zoo", "tiny_cnn", "tiny_mlp", "--requests", "30",
                     "--host-fraction", "0.4", "--memory", "64KiB", "--device", "cpu", "--json", str(path)])
    assert code == 0
    assert "bench tiers" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["requests_exact"] == data["requests"] == 30
    assert data["host_tier"]["drops"] > 0 and data["device_evictions"] > 0
    assert data["host_bytes_after_register"] == 0  # registered from files: nothing read yet
    assert data["plain_pytorch"]["total_s"] > 0 and data["floor_total_s"] > 0
    assert cli.main(["bench", "tiers", "--host-fraction", "0", "--device", "cpu"]) == 2
