"""``timeshare bench llm`` end to end on tiny models: every part runs, the cold greedy tokens
equal the warm ones, and in the fleet both servers (timeshare's and the reload-on-switch
baseline) answer every request with the same greedy text. Speed is the bench's to report,
not this test's."""

from __future__ import annotations

import json
import math

import pytest

from timeshare.cli import main

pytest.importorskip("transformers")


def test_bench_llm_runs_every_part_and_the_two_servers_agree(tmp_path):
    out = tmp_path / "llm.json"
    plot = tmp_path / "llm.png"
    code = main(["bench", "llm", "--size", "tiny", "--repeats", "2", "--prompt-tokens", "12", "--new-tokens", "6",
                 "--fleet-models", "3", "--fleet-requests", "6", "--fleet-rate", "6", "--fleet-max-tokens", "4",
                 "--device", "cpu", "--workdir", str(tmp_path / "models"), "--json", str(out), "--plot", str(plot)])
    assert code == 0
    r = json.loads(out.read_text())
    wake = r["wake"]
    assert wake["cold_tokens_exact"] == wake["cold_runs"] == 2
    assert wake["bytes"] > 0 and wake["cold_ttft_s"] > 0 and math.isfinite(wake["cold_over_warm_plus_copy"])
    assert r["decode"]["ours_tokens_per_s"] > 0 and r["decode"]["plain_tokens_per_s"] > 0
    fleet = r["fleet"]
    for server in ("timeshare", "reload_on_switch"):
        assert fleet[server]["ok"] == 6 and fleet[server]["failed"] == 0, fleet[server]["errors"]
        assert fleet[server]["completion_tokens"] > 0 and fleet[server]["loads"] >= 1
    assert fleet["texts_agree"] == 6
    assert plot.stat().st_size > 0
    assert len(r["models"]) == 3 and all(m["parameters"] > 0 for m in r["models"])


@pytest.mark.parametrize("args, words", [(["--workers", "1"], "workers must be 0"),
                                         (["--fleet-models", "2"], "at least 3 models"),
                                         (["--new-tokens", "1"], "new_tokens at least 2")])
def test_bench_llm_refuses_a_bad_option_before_it_builds_anything(tmp_path, capsys, args, words):
    code = main(["bench", "llm", "--size", "tiny", "--device", "cpu", "--workdir", str(tmp_path / "models"), *args])
    assert code != 0 and words in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "models").exists()
