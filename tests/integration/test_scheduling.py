"""The runtime's scheduler on the CPU backend: FIFO time-slicing against priority
preemption, policies by name, and the scheduling CLI commands."""

import json
import threading

import pytest
import torch

import timeshare
from tests import models
from timeshare import cli
from timeshare.errors import ConfigError


def _iterations_while_inference_waits(rt) -> tuple[int, int]:
    """Start endless training, then one inference; how many training iterations ran
    between the request and its answer, and the job's preemptions."""
    rt.register("inf", models.out_of_order, None, (torch.randn(2, 8),))
    rt.infer("inf", torch.randn(2, 8))  # resident
    job = rt.train("t", models.train_net, models.adam, models.endless_batches, models.train_step, seed=1)
    try:
        models.wait_until(lambda: job.stats.iterations >= 5, what="5 iterations")
        before = job.stats.iterations
        preempted = job.stats.preemptions
        rt.infer("inf", torch.randn(2, 8))
        ran = job.stats.iterations - before
        # The job's thread counts its preemption when it parks, which may come a moment
        # after the inference it gave way to has returned.
        try:
            models.wait_until(lambda: job.stats.preemptions > preempted, timeout_s=5, what="the preemption")
        except AssertionError:
            pass  # none: the caller's assertion says so
        return ran, job.stats.preemptions
    finally:
        job.cancel()
        assert job.wait(30)


def test_fifo_time_slicing_lets_the_job_finish_its_slice_first():
    with timeshare.Runtime(device="cpu", memory="16MiB", profile_repeats=1, scheduling="fifo",
                           time_slice_s=0.5) as rt:
        ran, _ = _iterations_while_inference_waits(rt)
    # The request waited for the rest of the job's half-second slice: many iterations.
    assert ran > 3


def test_priority_preempts_at_the_next_iteration_boundary():
    with timeshare.Runtime(device="cpu", memory="16MiB", profile_repeats=1, scheduling="priority") as rt:
        ran, preemptions = _iterations_while_inference_waits(rt)
    assert ran <= 2 and preemptions >= 1  # the iteration in flight, at most one more


def test_unknown_scheduling_policy_is_refused_with_the_known_names():
    with pytest.raises(ConfigError, match=r"unknown scheduling policy 'lottery'; known: \["):
        timeshare.Runtime(device="cpu", memory="1MiB", scheduling="lottery")
    with pytest.raises(ConfigError, match="lane_memory must be positive"):
        timeshare.Runtime(device="cpu", memory="1MiB", scheduling="pack", lane_memory=0)


def test_concurrent_calls_all_answered_exactly_next_to_training():
    with timeshare.Runtime(device="cpu", memory="16MiB", profile_repeats=1) as rt:
        rt.register("inf", models.out_of_order, None, (torch.randn(2, 8),))
        x = torch.randn(2, 8)
        ref = rt.infer("inf", x)["y"]
        job = rt.train("t", models.train_net, models.adam, models.endless_batches, models.train_step, seed=1)
        outs, errors = [], []

        def call():
            try:
                for _ in range(5):
                    outs.append(rt.infer("inf", x)["y"])
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        job.cancel()
        assert job.wait(30) and job.status == "cancelled"
        assert not errors and len(outs) == 20 and all(torch.equal(o, ref) for o in outs)
        assert rt.diagnostics().scheduler_tasks == 0  # nothing left queued


def test_sim_salus_and_serving_write_json(tmp_path, capsys):
    path = tmp_path / "salus.json"
    assert cli.main(["sim", "salus", "--jobs", "20", "--seeds", "2", "--json", str(path),
                     "--plot", str(tmp_path / "s.png")]) == 0
    data = json.loads(path.read_text())
    assert set(data["table"]) == {"fifo", "srtf", "pack", "fair"}
    assert data["table"]["srtf"]["avg_jct_min"] < data["table"]["fifo"]["avg_jct_min"]
    assert (tmp_path / "s.png").stat().st_size > 1000
    assert "Salus Table 1" in capsys.readouterr().out

    path = tmp_path / "serving.json"
    assert cli.main(["sim", "serving", "--models", "10", "--fit", "3", "--requests", "3000",
                     "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    modes = data["results"]
    assert {"lru", "clock", "second_chance", "working_set", "cost", "lru_count", "stop_and_start"} <= set(modes)
    for r in modes.values():
        assert r["tasks"] == 3000 and r["unfinished"] == 0
    # A process swap per model change is far slower than pipelined loads from host memory.
    assert modes["stop_and_start"]["inference"]["p50_ms"] > modes["lru"]["inference"]["p50_ms"]


def test_sim_run_replays_a_trace_file(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("time,kind,model,work,priority,slo_s\n0,inference,resnet152,1,lc,1\n"
                     "0.1,inference,bert_base,1,lc,\n")
    out = tmp_path / "r.json"
    assert cli.main(["sim", "run", "--trace", str(trace), "--policy", "edf", "--json", str(out)]) == 0
    report = json.loads(out.read_text())["report"]
    assert report["tasks"] == 2 and report["inference"]["requests"] == 2
    trace.write_text("time,kind,model\n0,cooking,resnet152\n")
    assert cli.main(["sim", "run", "--trace", str(trace)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_bench_scheduler_and_colocate(tmp_path, capsys):
    path = tmp_path / "sched.json"
    assert cli.main(["bench", "scheduler", "--queued", "100", "--decisions", "300", "--requests", "2000",
                     "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert {d["policy"] for d in data["decision"]} == {"fifo", "srtf", "pack", "fair", "priority", "edf"}
    assert all(d["median_us"] > 0 for d in data["decision"]) and data["replay"]["requests"] == 2000

    path = tmp_path / "colo.json"
    assert cli.main(["bench", "colocate", "--model", "tiny_mlp", "--train", "tiny_cnn:4", "--duration", "1.5",
                     "--rate", "20", "--device", "cpu", "--memory", "16MiB", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert set(data["modes"]) == {"fifo", "priority"}
    for r in data["modes"].values():
        assert r["outputs_match_ready"] is True and r["training_it_per_s"] > 0 and r["p95_ms"] > 0
    assert cli.main(["bench", "colocate", "--duration", "0"]) == 2


@pytest.mark.parametrize("from_arrival", [True, False])
def test_edf_counts_an_slo_from_the_request_arrival_when_given(from_arrival):
    """Two calls queue behind a holder. ``late`` arrived earlier (in a server's queue)
    with a tight SLO: counted from its arrival its deadline comes first; counted from
    when it reached the dispatcher it comes after ``early``'s."""
    from timeshare.runtime.dispatch import Dispatcher
    from timeshare.scheduler.task import Kind

    now = [100.0]
    gate = Dispatcher("edf", clock=lambda: now[0])
    order = []

    def call(name, deadline_s, arrived_at=None):
        with gate.hold(name, Kind.INFERENCE, deadline_s=deadline_s, arrived_at=arrived_at):
            order.append(name)

    with gate.hold("holder", Kind.INFERENCE):
        early = threading.Thread(target=call, args=("early", 1.0))  # deadline 101.0
        early.start()
        _wait_queued(gate, 1)
        now[0] = 100.5
        late = threading.Thread(target=call, args=("late", 0.8, 99.0 if from_arrival else None))
        late.start()  # deadline 99.8 from its arrival, 101.3 from now
        _wait_queued(gate, 2)
    early.join(30), late.join(30)
    assert order == (["late", "early"] if from_arrival else ["early", "late"])


def _wait_queued(gate, n: int, timeout_s: float = 30) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while gate.scheduler.waiting < n:
        assert time.monotonic() < deadline, "the call never reached the scheduler"
        time.sleep(0.005)
