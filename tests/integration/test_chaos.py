"""Issue 12's chaos test, short enough for CI: a real ``timeshare serve`` with two
workers and a training job, clients whose every reply is checked against its own
request's reference, and a fault every few seconds (workers killed while computing or
loading, training, idle or starting; stopped and resumed). The long run is
``timeshare bench chaos`` (results in bench/results/cpu/)."""

from timeshare.bench.chaos import FAULTS, ChaosBenchConfig, run


def test_faults_never_cost_a_wrong_answer_and_the_pool_heals():
    # A call deadline floor of 3 s: stops longer than that are killed as hung, and a call
    # slowed by a busy 2-core machine is not mistaken for one.
    # At least 4 faults, however long a busy machine makes each one take.
    cfg = ChaosBenchConfig(clients=4, duration_s=15, fault_every_s=2.5, stop_max_s=4.5, deadline_min_s=3.0,
                           distinct_inputs=3, seed=1, min_faults=4)
    out = run(cfg)
    r = out["result"]
    summary = {k: r[k] for k in ("requests", "answered", "wrong", "failed_by_status", "failed_outside_examples",
                                 "faults_by_kind", "heal_after_last_fault_s", "pool_at_end")}
    assert r["wrong"] == 0, r["wrong_examples"]
    assert r["final_check"]["wrong"] == [] and r["final_check"]["failed"] == [], r["final_check"]
    # Every failure is a 5xx of a request under way while a fault was; none is the client's fault.
    assert r["failed_4xx"] == 0 and r["failed_outside_faults"] == 0, summary
    assert all(s.isdigit() and int(s) >= 500 for s in r["failed_by_status"]), summary
    assert r["answered"] >= 100 and r["answered"] > 0.9 * r["requests"], summary
    assert r["faults"] >= 4 and sum(n > 0 for n in r["faults_by_kind"].values()) >= 3, summary
    assert set(r["faults_by_kind"]) == set(FAULTS)
    assert r["training_restarts_refused"] == 0, r["training_restart_refusals"]  # a job a fault ended starts again
    # Healed: back at full size after every fault; nothing left once the server stopped.
    assert r["not_healed"] == 0 and r["heal_after_last_fault_s"] is not None, summary
    assert r["pool_at_end"]["size"] == r["pool_at_end"]["ready"] == 2, summary
    assert r["server_exit_code"] == 0 and r["server_leftovers"] == []
    assert r["shm_segments_seen"] > len(cfg.models) and r["shm_segments_left"] == []  # the arena and host stores
