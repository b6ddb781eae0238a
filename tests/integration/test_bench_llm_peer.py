"""``timeshare bench llm --peer vllm`` end to end, with a stand-in for vLLM: a package named
``vllm`` whose ``entrypoints.openai.api_server`` takes vLLM's flags and serves the model
with ``timeshare serve`` (CI has no vLLM; ``make vllm-venv`` builds the real one). What
is checked is the bench's own work: in each run every server started, the start order
rotated, then the servers taking turns round by round; every measure present and positive; greedy text compared with
``transformers``' and with the peer's; the summary's medians, ranges and ratios; the JSON
and the plot. Speed is the bench's to report, not this test's."""

from __future__ import annotations

import json
import statistics
import sys
import textwrap

import pytest

from timeshare.cli import main

pytest.importorskip("transformers")

from timeshare.bench import llm_peer  # noqa: E402

STAND_IN = textwrap.dedent('''
    import argparse, sys
    from timeshare.cli import main
    p = argparse.ArgumentParser()
    for flag in ("--model", "--served-model-name", "--dtype", "--max-model-len", "--host", "--port"):
        p.add_argument(flag)
    a = p.parse_args()
    sys.exit(main(["serve", a.model, "--served-model-name", a.served_model_name, "--host", a.host,
                   "--port", a.port, "--metrics-port", "none", "--device", "cpu"]))
''')


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    root = tmp_path / "peer"
    api = root / "vllm" / "entrypoints" / "openai"
    api.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", api):
        (d / "__init__.py").write_text("")
    (api / "api_server.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.delenv("TIMESHARE_API_KEY", raising=False)
    return sys.executable


def test_the_peer_bench_alternates_servers_and_compares_every_measure(tmp_path, stand_in):
    config = llm_peer.PeerBenchConfig(python=stand_in, runs=2, repeats=2, new_tokens=40, prompt_words=8, long_words=120,
                                      concurrent=2, hidden=64, layers=2, heads=4, max_context=256,
                                      modes=("in-process",), workdir=str(tmp_path / "models"))
    seen: list[str] = []
    result = llm_peer.run(config, seen.append)
    starts = [s.split(": starting ")[1] for s in seen if ": starting " in s]
    assert starts == ["vllm", "timeshare in-process", "timeshare in-process", "vllm"]  # one at a time, rotated
    assert len(result["runs"]) == 2
    for run in result["runs"]:
        # Interleaved: every server's round i came before any server's round i + 1.
        at = [[run[name]["rounds"][i]["at"] for name in ("vllm", "in-process")] for i in range(2)]
        assert max(at[0]) < min(at[1])
        for name in ("vllm", "in-process"):
            m = run[name]
            assert all(m[k] > 0 for k in llm_peer.METRICS), (name, m)
            assert len(m["rounds"]) == 2
            assert m["decode_1_tokens"] >= 1 and len(m["decode_8_tokens"]) == 2
            # Greedy text: transformers' for the single request and each concurrent one.
            assert m["greedy_compared"] == 6 and m["greedy_equal_transformers"] == 6  # 2 repeats of 1 + 2
        assert run["in-process"]["greedy_equal_peer"] == 6
    summary = result["summary"]
    for name in ("in-process",):
        for metric in llm_peer.METRICS:
            values = [r[name][metric] for r in result["runs"]]
            s = summary[name][metric]
            assert s["min"] == min(values) and s["max"] == max(values) and s["min"] <= s["median"] <= s["max"]
            # Against the peer: the median of ratios of measures taken next to each other.
            if metric in llm_peer.ROUND_METRICS:
                pairs = [(a[metric], b[metric]) for r in result["runs"]
                         for a, b in zip(r[name]["rounds"], r["vllm"]["rounds"])]
            else:
                pairs = [(r[name][metric], r["vllm"][metric]) for r in result["runs"]]
            ratios = [b / a if metric in llm_peer.LOWER_IS_BETTER else a / b for a, b in pairs]
            assert len(ratios) == (4 if metric in llm_peer.ROUND_METRICS else 2)
            paired = summary[name]["paired"][metric]
            assert paired["median"] == pytest.approx(statistics.median(ratios))
            assert (paired["min"], paired["max"], paired["n"]) == (min(ratios), max(ratios), len(ratios))
            assert summary[name]["better_than_peer"][metric] == paired["median"]
    plot = tmp_path / "peer.png"
    llm_peer.plot(result, plot)
    assert plot.stat().st_size > 10_000
    json.dumps(result)  # the JSON the CLI writes


def test_the_peer_bench_says_how_to_get_a_peer_when_there_is_none(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(llm_peer.VLLM_PYTHON_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    code = main(["bench", "llm", "--peer", "vllm", "--json", str(tmp_path / "x.json")])
    assert code != 0
    out = capsys.readouterr()
    assert "make vllm-venv" in " ".join((out.out + out.err).split())
    assert not (tmp_path / "x.json").exists()


def test_prompts_are_the_same_for_every_server_and_the_prefix_differs_in_its_last_word_only():
    config = llm_peer.PeerBenchConfig(long_words=50, concurrent=3, repeats=3)
    a, b = llm_peer.Prompts.make(config), llm_peer.Prompts.make(config)
    assert a == b and len(a.singles) == 3 and all(len(g) == 3 for g in (*a.manys, *a.firsts))
    assert len({*a.singles, *sum(a.manys, ()), *sum(a.firsts, ()), a.short, *a.longs, *a.prefixes}) == 28
    assert a.decoded == [*a.singles, *sum(a.manys, ())]
    assert len(a.longs) == len(a.prefixes) == 3
    for long, prefix in zip(a.longs, a.prefixes):
        long, prefix = long.split(), prefix.split()
        assert len(long) == len(prefix) == 50 and long[:-1] == prefix[:-1] and long[-1] != prefix[-1]
    with pytest.raises(Exception, match="does not fit"):
        llm_peer.PeerBenchConfig(long_words=5000)
