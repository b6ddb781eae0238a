"""``timeshare serve`` in front of a cluster (NOTE [A cluster behind the server]): the
same HTTP APIs from replicas on a real local Ray cluster, a replica killed and one added
through the admin plane, a training job that moves on its own when it starves
(NOTE [Migration of starved jobs]), and the refusals of the config."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import threading
import time

import httpx
import pytest
import torch

from timeshare.bench.cluster import references
from timeshare.bench.common import outputs_equal
from timeshare.cluster.backend import ClusterRuntime, add_snapshots
from timeshare.cluster.cluster import Cluster, start_local_ray
from timeshare.cluster.replica import ModelDef
from timeshare.config import parse_config
from timeshare.errors import ConfigError
from timeshare.harness.client import Client
from timeshare.harness.process import ServerProcess
from timeshare.models.workloads import TrainingWorkload
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.server.endpoint import flatten_outputs

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs Ray")
ZOO = ("tiny_mlp", "tiny_cnn", "small_resnet", "tiny_bert")


def _config(llm=None, **cluster) -> dict:
    return {"runtime": {"device": "cpu", "memory": "4MiB", "kv_memory": "1MiB"},
            "models": [{"name": z, "zoo": z} for z in ZOO],
            "llms": [] if llm is None else [{"name": "llama", "path": str(llm), "max_sequences": 2}],
            "training": [{"name": "bg", "model": "tiny_cnn", "batch": 4, "iterations": 40}],
            "cluster": {"replicas": 2, "num_cpus": 5, **cluster}}


def _inputs(zoo: str) -> dict[str, torch.Tensor]:
    zm = zoo_get(zoo)
    return dict(zip(zm.input_names, zm.example_inputs(1), strict=True))


def _admin(server: ServerProcess, method: str, path: str) -> httpx.Response:
    return httpx.request(method, server.url + path, timeout=300)


def _metrics_with(client: Client, *wanted: str, timeout_s: float = 30.0) -> str:
    """The server's metrics once they show every ``wanted`` line (what the replicas count
    reaches the front end with its next poll of them), or as they are at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = client.metrics_text()
        if all(w in text for w in wanted) or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


@needs_ray
def test_serve_fronts_a_cluster_with_the_same_apis_and_survives_a_replica_killed(tmp_path):
    """Open Inference Protocol models, a language model through the OpenAI API (NOTE
    [Language models on a cluster]: greedy text equal to ``transformers``' ``generate``,
    streamed or not), a training job, the admin plane and the metrics, in front of two
    replicas; then one replica killed and one added."""
    openai = pytest.importorskip("openai")
    transformers = pytest.importorskip("transformers")
    from tests.integration.test_llm_server import decode, reference
    from timeshare.llm import hfdir

    llm = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=3, hidden=128, layers=4)  # 2.8 MB
    tok = transformers.AutoTokenizer.from_pretrained(llm)
    prompt = "the replicas share the load"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    want = decode(llm, reference(llm, ids, 16))
    refs = references([ModelDef(z, z, str(weights_path(z))) for z in ZOO])
    with ServerProcess(_config(llm, migrate_after_s=None), ready_timeout_s=300) as server, \
            Client(server.url) as client, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as chat:

        def complete() -> None:
            out = chat.completions.create(model="llama", prompt=prompt, max_tokens=16, temperature=0)
            assert out.choices[0].text == want and out.usage.completion_tokens == 16
            assert out.usage.prompt_tokens == len(ids)

        def check_all() -> None:
            for z in ZOO:
                answer = client.infer(z, _inputs(z))
                assert answer.status == 200, answer.error
                expected = dict(flatten_outputs(refs[z]))
                assert answer.outputs.keys() == expected.keys(), z
                assert all(outputs_equal(answer.outputs[k], expected[k]) for k in expected), z

        for _ in range(3):
            check_all()
        assert [m.id for m in chat.models.list().data] == ["llama"]
        complete()
        chunks = chat.completions.create(model="llama", prompt=prompt, max_tokens=16, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        bad = httpx.post(f"{server.url}/v1/completions", json={"model": "llama", "prompt": prompt,
                                                                "max_tokens": 100000}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "context_length_exceeded"
        replicas = _admin(server, "GET", "/admin/replicas").json()
        assert replicas["replicas_alive"] == 2 and replicas["policy"] == "timeshare"
        assert replicas["requests"] >= 12 and replicas["failed"] == 0
        status = _admin(server, "GET", "/admin/status").json()
        assert status["ready"] and status["device"].startswith("cpu x ")
        assert status["capacity_bytes"] == 2 * 4 * 2**20  # the replicas' budgets added up
        wanted = ("timeshare_cluster_replicas 2.0", 'timeshare_requests_total{code="200",model="tiny_mlp"}',
                  "timeshare_replica_loads_total{replica=",
                  'timeshare_llm_time_to_first_token_seconds_count{model="llama"} 2.0',
                  'timeshare_llm_tokens_total{kind="completion",model="llama"} 32.0')
        metrics = _metrics_with(client, *wanted)  # the replicas' counters arrive with the next poll
        for line in wanted:
            assert line in metrics, line

        # A replica killed: every request still answers, exactly; it is counted as lost.
        victim = replicas["replicas"][0]["replica"]
        assert _admin(server, "POST", f"/admin/replicas/{victim}/kill").status_code == 200
        check_all()
        deadline = time.monotonic() + 10  # found by a request sent there, or by the next poll
        while (after := _admin(server, "GET", "/admin/replicas").json())["replicas_alive"] != 1:
            assert time.monotonic() < deadline, after
            time.sleep(0.1)
        assert after["replicas_lost"] == 1 and after["failed"] == 0
        # On the one replica left, the language model (2.8 MB) and small_resnet (2.2 MB) do
        # not fit in 4 MiB together: its evictions reach the front end's counters.
        complete()
        check_all()
        assert "timeshare_evictions_total{model=" in _metrics_with(client, "timeshare_evictions_total{model=")
        # One added at run time serves.
        added = _admin(server, "POST", "/admin/replicas")
        assert added.status_code == 201, added.text
        check_all()
        assert _admin(server, "GET", "/admin/replicas").json()["replicas_alive"] == 2

        # The config's training job ran on a replica, reported through the same admin plane
        # (unless its replica was the one killed: then it failed, saying so).
        deadline = time.monotonic() + 120
        while True:
            job = _admin(server, "GET", "/admin/training/bg").json()
            if job["status"] in ("finished", "failed") or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert job["status"] == "finished" and job["iterations"] == 40 or \
            job["status"] == "failed" and "was lost" in job["error"], job
        # What a cluster cannot do is refused clearly.
        r = _admin(server, "POST", "/admin/models/tiny_mlp/pin")
        assert r.status_code == 409 and "cannot be pinned" in r.json()["error"]
    assert server.exit_code == 0, server.log_tail()
    assert server.leftovers(grace_s=20) == [], [ServerProcess.describe(p) for p in server.leftovers(0)]


@needs_ray
def test_a_cluster_serves_adapters_added_at_run_time_on_every_replica_and_on_one_added_later(tmp_path):
    """NOTE [Adapters on a cluster] through the OpenAI API, on a cluster that serves a
    language model alone (no model for the router to place): an adapter of the config, one
    loaded by vLLM's route and one found by the resolver each answer with PEFT's greedy
    text from two replicas, are listed with their parent, and a bad one is a 400; a replica
    added after that, once the two first are killed, answers for every one of them (the
    one loaded at run time included); unloaded, it is a 404."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("peft")
    from tests.integration.test_llm_server import decode
    from tests.llm_reference import peft_greedy, write_adapter
    from timeshare.llm import hfdir

    llm = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=3, hidden=64, layers=2)
    paths = {"a1": write_adapter(llm, tmp_path / "a1", rank=4, targets=["q_proj", "v_proj"], seed=1, std=0.3),
             "a2": write_adapter(llm, tmp_path / "a2", rank=8, targets=["gate_proj", "down_proj"], seed=2, std=0.3),
             "a3": write_adapter(llm, tmp_path / "loras" / "a3", rank=4, targets=["o_proj"], seed=3, std=0.3)}
    big = write_adapter(llm, tmp_path / "big", rank=16, targets=["q_proj"], seed=4)
    prompt = "the replicas share the load"
    ids = transformers_ids(llm, prompt)
    want = {n: decode(llm, peft_greedy(llm, p)(ids, 12)) for n, p in [("llama", None), *paths.items()]}
    assert len(set(want.values())) == 4  # each adapter changes the answer
    config = {"runtime": {"device": "cpu", "memory": "12MiB"},  # language models alone: no router
              "llms": [{"name": "llama", "path": str(llm), "max_sequences": 2, "max_loras": 2, "max_lora_rank": 8,
                        "adapters": [{"name": "a1", "path": str(paths["a1"])}],
                        "lora_dir": str(tmp_path / "loras")}],
              "cluster": {"replicas": 2, "num_cpus": 5, "migrate_after_s": None}}
    with ServerProcess(config, ready_timeout_s=300) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as chat:

        def answer(name: str) -> str:
            out = chat.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
            assert out.model == name
            return out.choices[0].text

        assert answer("llama") == want["llama"] and answer("a1") == want["a1"]
        for path in ("/admin/status", "/admin/replicas", "/metrics"):  # no router: the rest reports as ever
            assert httpx.get(server.url + path, timeout=60).status_code == 200, path
        assert _admin(server, "GET", "/admin/replicas").json()["replicas_alive"] == 2
        load = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": "big", "lora_path": str(big)})
        assert load.status_code == 400 and "exceeds max_lora_rank 8" in load.text
        load = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": "a2", "lora_path": str(paths["a2"])})
        assert load.status_code == 200, load.text
        assert answer("a2") == want["a2"] and answer("a3") == want["a3"]  # a3: the resolver's
        cards = {m.id: m.model_extra.get("parent") for m in chat.models.list().data}
        assert cards == {"llama": None, "a1": "llama", "a2": "llama", "a3": "llama"}
        first = [r["replica"] for r in _admin(server, "GET", "/admin/replicas").json()["replicas"]]
        assert _admin(server, "POST", f"/admin/replicas/{first[0]}/kill").status_code == 200
        assert _admin(server, "POST", "/admin/replicas").status_code == 201
        assert _admin(server, "POST", f"/admin/replicas/{first[1]}/kill").status_code == 200
        deadline = time.monotonic() + 10  # the listing learns of the deaths by the next poll
        while len(left := [r["replica"] for r in _admin(server, "GET", "/admin/replicas").json()["replicas"]
                           if r["alive"]]) != 1:
            assert time.monotonic() < deadline, left
            time.sleep(0.1)
        assert left[0] not in first
        # Only the replica added after the run-time load is left: it serves what the others did.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # as many as one replica generates at once
            assert list(pool.map(answer, ["a2", "a1", "a3", "llama"])) == [want[n] for n in ["a2", "a1", "a3", "llama"]]
        unload = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a2"}, timeout=60)
        assert unload.status_code == 200, unload.text
        with pytest.raises(openai.NotFoundError):
            answer("a2")
    assert server.exit_code == 0, server.log_tail()


def transformers_ids(path, text: str) -> list[int]:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)(text, add_special_tokens=False)["input_ids"]


@needs_ray
def test_a_starved_training_job_moves_to_an_idle_replica_and_ends_as_if_never_moved():
    """The job runs where a model is resident; requests to that model (50 times the
    job's iteration) keep that replica busy (inference preempts training), so the job
    gets a sliver of its device and the front end moves it to the idle replica (NOTE
    [Migration of starved jobs]); its weights equal a job never interrupted."""
    ray = start_local_ray(4)
    try:
        model = ModelDef("mlp", "small_resnet", str(weights_path("small_resnet")), batch=16)
        cluster = Cluster([model], replicas=2, memory="4MiB")
        backend = ClusterRuntime(cluster, migrate_after_s=0.5, poll_s=0.1)
        moved_once = threading.Event()
        migrate = backend.migrate

        def migrate_and_tell(*args, **kwargs):  # the front end's own move, then the event the test waits on
            try:
                return migrate(*args, **kwargs)
            finally:
                moved_once.set()

        backend.migrate = migrate_and_tell
        try:
            args = model.example_inputs()
            backend.infer("mlp", *args)
            busy = next(r.replica for r in cluster.replica_rows() if r.routed_resident)
            actor = next(slot.actor for slot in cluster.slots if slot.name == busy)
            workload = TrainingWorkload.parse("tiny_cnn:8")
            kwargs = {**workload.train_args(), "iterations": 200, "seed": 3}
            cluster.start_job("job", kwargs, replica=busy)
            stop = threading.Event()

            # Straight to the job's replica, past the router: the router follows a model's
            # demand and would route a stream like this one to the other replica too, which
            # would then never look idle (a request in flight there) and the job never move.
            def hammer():  # a stream of requests with no gap: the job's replica never idles
                while not stop.is_set():
                    ray.get(actor.infer.remote("mlp", args), timeout=60)

            threads = [threading.Thread(target=hammer) for _ in range(3)]
            for t in threads:
                t.start()
            moved_once.wait(timeout=90)
            stop.set()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads)
            assert backend.migrations, "the starved job did not move"
            moved = backend.migrations[0]
            assert moved["from"] == busy and moved["to"] != busy
            assert cluster.status()["migrations"] >= 1
            weights = cluster.job_weights("job", timeout_s=120)
            assert cluster.job("job")["resumed_at"] > 0
            # The same job never interrupted, on a replica too (one thread per replica:
            # the same kernels as the moved job's).
            cluster.start_job("whole", kwargs, replica=busy)
            reference = cluster.job_weights("whole", timeout_s=120)
        finally:
            backend.close()
        assert weights.keys() == reference.keys()
        assert all(torch.equal(weights[k], reference[k]) for k in reference)
    finally:
        ray.shutdown()


def test_a_cluster_config_refuses_what_a_cluster_cannot_do(tmp_path):
    base = {"runtime": {"device": "cpu", "memory": "3MiB"}, "models": [{"name": "m", "zoo": "tiny_mlp"}],
            "cluster": {"replicas": 2}}
    assert parse_config(base).cluster.replicas == 2
    from timeshare.server.service import Service

    service = Service(parse_config(base))  # nothing starts before open()
    try:
        assert service.runner.batches == 2  # a model's batches: one per replica at once
    finally:
        service.parsers.close()
    bad = [
        ({**base, "models": [{"name": "m", "zoo": "tiny_mlp", "pinned": True}]}, "cannot be pinned"),
        ({**base, "runtime": {"device": "auto", "memory": "3MiB"}}, "not 'auto'"),
        ({**base, "runtime": {"device": "cuda:1", "memory": "3MiB"}}, "each replica's own GPU"),
        ({**base, "cluster": {"replicas": 3, "max_replicas": 2}}, "must be at least replicas"),
        ({**base, "cluster": {"policy": "nearest"}}, "cluster.policy"),
    ]
    for doc, message in bad:
        with pytest.raises(ConfigError, match=message):
            parse_config(doc)


def test_replica_snapshotsadd_snapshots_up():
    a = {"capacity_bytes": 10, "resident": {"x": 1}, "loads": {"x": 2, "y": 0}, "workers": None,
         "lanes": {"lanes": [1], "capacity": 5}, "device": "cpu", "ok": True}
    b = {"capacity_bytes": 20, "resident": {"y": 3}, "loads": {"x": 1, "y": 4}, "workers": None,
         "lanes": {"lanes": [2], "capacity": 6}, "device": "cpu", "ok": False}
    assert add_snapshots([a, b]) == {"capacity_bytes": 30, "resident": {"x": 1, "y": 3}, "loads": {"x": 3, "y": 4},
                            "workers": None, "lanes": {"lanes": [1, 2], "capacity": 11}, "device": "cpu",
                            "ok": False}

