"""``timeshare bench overhead`` on the CPU, as a campaign step: its JSON, its checks of
exactness, its summary; and the fair lock its baseline uses."""

import json
import threading
import time

from timeshare.bench import campaign, campaign_summary
from timeshare.bench.campaign import Step
from timeshare.bench.overhead import FairLock


def test_the_overhead_step_measures_every_part_and_the_summary_reports_it(tmp_path):
    # The least that exercises every part: one worker, one round, three models, short measurements.
    step = Step("overhead", ("overhead", "--device", "cpu", "--workers", "1", "--rounds", "1", "--calls", "5",
                             "--threads", "1", "3", "--model-counts", "3", "--duration", "0.1",
                             "--transfer-repeats", "1"), 240)
    rec = campaign.run_step(step, tmp_path)
    assert rec["returncode"] == 0 and not rec["timed_out"], (tmp_path / "overhead.log").read_text()
    r = json.loads((tmp_path / "overhead.json").read_text())
    single = r["single"]
    assert single["outputs_exact"] is True
    assert set(single["us_per_call"]) == {"plain_pytorch", "in_process", "workers"}
    u = single["us_per_call"]
    assert single["workers_over_in_process_us"] == u["workers"] - u["in_process"]
    (block,) = r["threads"]
    assert block["models"] == 3 and [row["threads"] for row in block["rows"]] == [1, 3]
    for row in block["rows"]:
        for way in ("timeshare", "plain_pytorch", "plain_pytorch_fair"):
            assert row[way]["requests"] == sum(row[way]["per_client"]) > 0
            assert len(row[way]["per_client"]) == row["threads"]
    assert block["rows"][0]["cpu_per_request_vs_one_thread"] == 1.0
    rows = r["transfer"]["rows"]
    assert {(x["head"], x["input"]) for x in rows} == {(h, s) for h in ("input", "echo") for s in ("4.8MB", "8.6MB")}
    assert all(x["outputs_exact"] for x in rows)
    assert {x["input_bytes"] for x in rows} == {8 * 3 * 224 * 224 * 4, 8 * 3 * 299 * 299 * 4}
    pack = r["pack"]
    assert pack["pack_over_fifo"] == pack["pack"]["req_per_s"] / pack["fifo"]["req_per_s"]
    summary = campaign_summary.summarize(tmp_path)
    assert summary["overhead"]["pack_over_fifo"] == pack["pack_over_fifo"]
    assert "The runtime's own cost" in (tmp_path / "SUMMARY.md").read_text()


def test_the_fair_lock_hands_over_in_arrival_order():
    lock = FairLock()
    order: list[int] = []
    ready = []

    def take(i: int) -> None:
        with lock:
            order.append(i)

    with lock:
        for i in range(6):
            t = threading.Thread(target=take, args=(i,))
            t.start()
            ready.append(t)
            deadline = time.monotonic() + 10
            while lock.waiting < i + 1:  # queued before the next one starts
                assert time.monotonic() < deadline
                time.sleep(0.001)
    for t in ready:
        t.join(10)
    assert order == list(range(6))
    with lock:  # free again, taken at once
        pass
