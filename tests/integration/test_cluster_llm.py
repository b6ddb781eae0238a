"""NOTE [Language models on a cluster], without Ray: a replica's generations (a cancel
that arrives before its generation is not lost), and the front end's relay of a stream
(the token count of a generation cut short, an error that is the replica's own)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from timeshare.cluster.llm import RemoteEngine, RemoteGeneration, relay
from timeshare.cluster.replica import Replica
from timeshare.errors import Timeout
from timeshare.llm.engine import EngineSnapshot
from timeshare.llm.model import LLMDef
from timeshare.llm.sampling import SamplingParams
from timeshare.llm.sequence import Delta, Finish, SequenceDone, TokenTiming

transformers = pytest.importorskip("transformers")


def test_a_cancel_that_comes_before_its_generation_stops_it_there(tmp_path):
    from timeshare.llm import hfdir

    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=3, hidden=64, layers=2)
    replica = Replica("r", [], memory="4MiB", llms=[LLMDef("llama", str(path))])
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0)
        whole = list(replica.generate("llama", [1, 2, 3], greedy, "a"))
        assert isinstance(whole[-1], Finish) and whole[-1].reason == "length" and whole[-1].completion_tokens == 8
        replica.cancel_generation("b")  # before "b" reaches the replica
        cut = list(replica.generate("llama", [1, 2, 3], SamplingParams(max_tokens=200, temperature=0), "b"))
        assert cut[-1].reason == "cancelled" and cut[-1].completion_tokens < 200
        assert replica.snapshot().llms["llama"].running == 0
    finally:
        replica.close()


class _Owner:
    def __init__(self, snapshots=()):
        self.snapshots = list(snapshots)

    def llm_snapshots(self, name):
        return self.snapshots


def test_a_models_engine_on_a_cluster_adds_up_its_replicas_counts_adapter_slots_too():
    one = EngineSnapshot(running=1, waiting=2, kv_bytes=3, kv_host_bytes=1, kv_offloads=1, steps=5, turns=2,
                         max_sequences=4, max_context=64, prefill_tokens=7, masks=1, mask_s=0.5, adapter_slots=2,
                         adapters_on_device=1, adapter_loads=3, adapter_load_s=0.25)
    other = replace(one, running=0, adapters_on_device=2, adapter_loads=1, adapter_load_s=0.5)
    got = RemoteEngine(_Owner([one, other]), "m", 8, 128).snapshot()
    assert got == EngineSnapshot(running=1, waiting=4, kv_bytes=6, kv_host_bytes=2, kv_offloads=2, steps=10,
                                 turns=4, max_sequences=8, max_context=128, prefill_tokens=14, masks=2, mask_s=1.0,
                                 adapter_slots=4, adapters_on_device=3, adapter_loads=4, adapter_load_s=0.75)


def test_the_relay_counts_tokens_and_keeps_the_replicas_own_error():
    engine = RemoteEngine(_Owner(), "m", 4, 64)
    seen = []
    engine.subscribe(seen.append)

    def stream(error):
        yield Delta("a", 1)
        yield Delta("bc", 3)  # a delta carries the count of tokens so far
        raise error

    got = []
    generation = RemoteGeneration(lambda: None, got.append)
    relay(stream(Timeout("late")), generation, engine, "m", 5, 0.0, lambda exc: exc)
    finish = got[-1]
    assert isinstance(finish, Finish) and finish.reason == "error" and finish.completion_tokens == 3
    assert isinstance(finish.error, Timeout) and finish.prompt_tokens == 5
    assert [type(e) for e in seen] == [TokenTiming, TokenTiming, SequenceDone]
    assert [e.first for e in seen[:2]] == [True, False]
    # A stream that ends with its finish is passed on as it is, once.
    got.clear()
    relay(iter([Delta("x", 1), Finish("stop", 2, 1)]), RemoteGeneration(lambda: None, got.append), engine, "m",
          2, 0.0, lambda exc: exc)
    assert got == [Delta("x", 1), Finish("stop", 2, 1)]


def test_a_replica_serves_adapters_added_and_removed_and_reports_their_slots(tmp_path):
    """NOTE [Adapters on a cluster], a replica's side: the adapters of its ``LLMDef``
    loaded at its start, one added and one removed at run time, each generating PEFT's
    greedy tokens; its snapshot says which are on its device."""
    pytest.importorskip("peft")
    from tests.llm_reference import peft_greedy, write_adapter
    from timeshare.errors import UnknownModelError
    from timeshare.llm import hfdir

    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=3, hidden=64, layers=2)
    a1 = write_adapter(path, tmp_path / "a1", rank=4, targets=["q_proj", "v_proj"], seed=1, std=0.3)
    a2 = write_adapter(path, tmp_path / "a2", rank=8, targets=["gate_proj", "down_proj"], seed=2, std=0.3)
    spec = LLMDef("llama", str(path), adapters=(("a1", str(a1), False),), max_loras=2, max_lora_rank=8)
    assert spec.serves_adapters and not LLMDef("llama", str(path)).serves_adapters
    assert spec.with_adapter("a2", str(a2)).adapters == (("a1", str(a1), False), ("a2", str(a2), False))
    assert spec.with_adapter("a1", None).adapters == ()
    replica = Replica("r", [], memory="8MiB", llms=[spec])
    try:
        prompt = [5, 9, 14, 3]
        greedy = SamplingParams(max_tokens=8, temperature=0)

        def tokens(adapter):
            events = list(replica.generate("llama", prompt, greedy, f"g-{adapter}", adapter=adapter))
            assert isinstance(events[-1], Finish) and events[-1].error is None, events[-1]
            return replica.llms["llama"].encode("".join(e.text for e in events if isinstance(e, Delta)))

        want = {name: peft_greedy(path, at)(prompt, 8) for name, at in [(None, None), ("a1", a1), ("a2", a2)]}
        assert want["a1"] != want[None] and want["a2"] != want[None]  # the adapters change the answer
        served = replica.llms["llama"]
        for name in [None, "a1"]:
            seq = served.generate(prompt, greedy, adapter=name)
            assert seq.result(60).tokens == want[name], name
        assert tokens("a1")  # through the replica's own generator
        replica.add_adapter("llama", "a2", str(a2))
        assert served.generate(prompt, greedy, adapter="a2").result(60).tokens == want["a2"]
        slots = {i.name: i.slot for i in replica.snapshot().adapters["llama"]}
        assert sorted(slots) == ["a1", "a2"] and sorted(slots.values()) == [1, 2]
        assert replica.remove_adapter("llama", "a2") and not replica.remove_adapter("llama", "a2")
        with pytest.raises(UnknownModelError):
            served.generate(prompt, greedy, adapter="a2")
    finally:
        replica.close()


class _Fleet:
    """A cluster's side of the front end's adapter table, recorded."""

    def __init__(self):
        self.calls = []

    def adapt(self, model, name, path, pinned=False, restore=None):
        self.calls.append((model, name, path, restore))

    def adapter_slots(self, model):
        return {"a1": 3}


def test_the_front_end_checks_an_adapter_before_any_replica_reads_it(tmp_path):
    """NOTE [Adapters on a cluster], the front end's side: adapters are read once to be
    checked against the replicas' slots (a bad one refused with the reason, and no replica
    told), added and removed on every replica, found by the resolver on a first request."""
    import json

    import torch

    pytest.importorskip("peft")
    from tests.llm_reference import write_adapter
    from timeshare.cluster.llm import RemoteAdapters
    from timeshare.errors import ConfigError, UnknownModelError
    from timeshare.llm import hfdir

    path = hfdir.write_model_dir(tmp_path / "llama", "llama", seed=3, hidden=64, layers=2)
    resolve = tmp_path / "resolve"
    a1 = write_adapter(path, tmp_path / "a1", rank=4, targets=["q_proj"], seed=1)
    write_adapter(path, resolve / "a3", rank=4, targets=["v_proj"], seed=3)
    big = write_adapter(path, tmp_path / "big", rank=16, targets=["q_proj"], seed=4)
    spec = LLMDef("llama", str(path), adapters=(("a1", str(a1), True),), max_loras=2, max_lora_rank=8,
                  lora_dir=str(resolve))
    fleet = _Fleet()
    config = transformers.AutoConfig.from_pretrained(path)
    table = RemoteAdapters(fleet, spec, config, torch.float32)
    assert [i.name for i in table.infos()] == ["a1"] and table.get("a1") == "a1"
    with pytest.raises(ConfigError, match="rank 16 of .* exceeds max_lora_rank 8"):
        table.add("big", big)
    with pytest.raises(ConfigError, match="already loaded"):
        table.add("a1", a1)
    assert fleet.calls == []  # refused here: no replica was told
    table.add("a2", a1)
    assert fleet.calls == [("llama", "a2", str(a1), None)]
    other = write_adapter(path, tmp_path / "other", rank=2, targets=["k_proj"], seed=5)
    table.add("a2", other, replace=True)  # what a refused replace would put back: the one before
    assert fleet.calls[-1] == ("llama", "a2", str(other), str(a1))
    assert table.get("a3") == "a3" and table.serves("a3") and fleet.calls[-1][1] == "a2"  # each replica resolves
    (resolve / "bad").mkdir()
    (resolve / "bad" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(ConfigError, match="no adapter_model.safetensors"):
        table.get("bad")
    with pytest.raises(UnknownModelError):
        table.get("nowhere")
    infos = {i.name: (i.slot, i.pinned, i.parent) for i in table.infos()}
    assert infos == {"a1": (3, True, "llama"), "a2": (None, False, "llama"), "a3": (None, False, "llama")}
    table.remove("a2")
    assert fleet.calls[-1] == ("llama", "a2", None, None) and not table.serves("a2")
    with pytest.raises(UnknownModelError):
        table.remove("a2")


class _TaskError(Exception):
    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause


class _Ray:
    """Ray as ``ReplicaSet`` calls it: a remote call's reference is its answer, or its error."""

    class exceptions:
        RayTaskError = _TaskError

    def get(self, ref, timeout=None):
        if isinstance(ref, BaseException):
            raise ref
        return ref


class _Call:
    def __init__(self, fn):
        self.remote = fn


class _Actor:
    """A replica's adapter calls, recorded; ``refuses``: a load of that directory fails there."""

    def __init__(self, refuses=None, dead=False):
        self.served: dict[str, tuple[str, bool]] = {}
        self.refuses, self.dead = refuses, dead
        self.add_adapter = _Call(self._add)
        self.remove_adapter = _Call(self._remove)

    def _add(self, model, name, path, replace, pinned):
        if self.dead:
            return RuntimeError("the actor died")
        if path == self.refuses:
            from timeshare.errors import ConfigError

            return _TaskError(ConfigError(f"{path} cannot be read here"))
        assert replace  # the front end has the last word on a name: a replica replaces
        self.served[name] = (path, pinned)

    def _remove(self, model, name):
        self.served.pop(name, None)
        return True


def test_a_run_time_adapter_reaches_every_replica_or_none_and_the_replicas_started_later():
    """NOTE [Adapters on a cluster], the replica set's side: a load reaches every live
    replica (a dead one is lost, not an error) and the LLMDef later replicas start from;
    one a replica refuses is taken back from the others (a new one removed, a replaced
    one put back as it was) and the LLMDef left as it was; pins reach the replicas and
    stay through a replace."""
    from timeshare.cluster.replicas import ReplicaSet, ReplicaSlot
    from timeshare.errors import ConfigError

    lost = []
    replicas = ReplicaSet(_Ray(), None, [], memory=1, device="cpu", runtime=None, cpu_fallback=None,
                          llms=[LLMDef("llama", "/m", max_loras=2)], call_timeout_s=1, start_timeout_s=1,
                          on_lost=lost.append)
    good, picky, gone = _Actor(), _Actor(refuses="/far"), _Actor(dead=True)
    replicas.slots = [ReplicaSlot("r0", good, True), ReplicaSlot("r1", picky, True), ReplicaSlot("r2", gone, True)]
    replicas.adapt("llama", "a", "/a", pinned=True)
    assert good.served == picky.served == {"a": ("/a", True)} and lost == [2]  # r2 lost, not an error
    assert replicas.llms[0].adapters == (("a", "/a", True),)
    from types import SimpleNamespace

    from timeshare.cluster.cluster import Cluster

    # What the front end builds a model's table from again (unloaded and loaded) has it too.
    assert Cluster.llms.fget(SimpleNamespace(replicas=replicas))["llama"].adapters == (("a", "/a", True),)
    with pytest.raises(ConfigError, match="cannot be read here"):
        replicas.adapt("llama", "b", "/far")
    assert "b" not in good.served and replicas.llms[0].adapters == (("a", "/a", True),)
    with pytest.raises(ConfigError, match="cannot be read here"):
        replicas.adapt("llama", "a", "/far", restore="/a")
    assert good.served["a"] == ("/a", True) and replicas.llms[0].adapters == (("a", "/a", True),)
    replicas.adapt("llama", "a", "/a2")  # a replace keeps the pin
    assert good.served["a"] == ("/a2", True) and replicas.llms[0].adapters == (("a", "/a2", True),)
    with pytest.raises(ConfigError, match="cannot be read here"):  # put back from the LLMDef, not the caller
        replicas.adapt("llama", "a", "/far", restore="/stale")
    assert good.served["a"] == ("/a2", True)
    replicas.adapt("llama", "a", None)
    assert good.served == picky.served == {} and replicas.llms[0].adapters == ()


class _Generating:
    """A replica's actor as ``Generations`` starts a generation on it."""

    def __init__(self):
        self.generate = self

    def options(self, **_):
        return _Call(lambda *args: args)


def test_a_generation_of_an_adapter_goes_where_its_adapter_was_last_while_there_is_room(monkeypatch):
    """NOTE [Adapters on a cluster]: an adapter's next generation goes to the replica that
    generated for it last (its slot likely still holds it), while that one has room, before
    the model's last replica; an adapter loaded again or unloaded has no such replica."""
    from types import SimpleNamespace

    from timeshare.cluster import generations as generations_module
    from timeshare.cluster.cluster import Cluster
    from timeshare.cluster.generations import Generations
    from timeshare.cluster.replicas import ReplicaSet, ReplicaSlot
    from timeshare.errors import ConfigError

    llama = LLMDef("llama", "/m", max_sequences=2)
    replicas = ReplicaSet(_Ray(), None, [], memory=1, device="cpu", runtime=None, cpu_fallback=None,
                          llms=[llama], call_timeout_s=1, start_timeout_s=1, on_lost=lambda i: None)
    replicas.slots = [ReplicaSlot("r0", _Generating(), True), ReplicaSlot("r1", _Generating(), True)]
    generations = Generations(replicas, [llama])
    started = {}

    def start(key, adapter):
        started[key] = generations.generate("llama", [1], None, key, adapter)
        return started[key][0]

    assert [start("g1", "a"), start("g2", "a"), start("g3", "b")] == [0, 0, 1]  # r0 full: b to r1
    started["g1"][2]()
    started["g2"][2]()
    assert start("g4", "a") == 0  # a's replica, not the model's last (r1), which has room too
    assert start("g5", "b") == 1  # b's, not the model's last (r0)
    assert start("g6", "a") == 0
    started["g3"][2]()
    started["g4"][2]()

    class _Adapting:  # a replica set whose loads succeed, or are refused
        refuse = False

        def adapt(self, *args):
            if self.refuse:
                raise ConfigError("refused")

    adapting = _Adapting()
    cluster = SimpleNamespace(replicas=adapting, generations=generations)
    Cluster.adapt(cluster, "llama", "b", "/b2")  # loaded again: no replica holds it
    assert start("g7", "b") == 0  # the model's last replica, though b's last (r1) has room
    assert start("g8", "c") == 1  # r0 full: c to r1, the model's last replica now
    for key in ("g5", "g7"):
        started[key][2]()
    adapting.refuse = True
    with pytest.raises(ConfigError):
        Cluster.adapt(cluster, "llama", "a", None)  # refused: some replicas may have dropped it meanwhile
    assert start("g9", "a") == 1  # the model's last replica, though a's last (r0) has room
    replicas.slots[1].alive = False  # that replica lost: the next goes to a live one
    assert start("g10", "a") == 0
    for key in ("g6", "g8", "g9", "g10"):
        started[key][2]()
    replicas.slots[1].alive = True
    # Past ADAPTER_HOMES adapters, the least recently routed one's replica is forgotten.
    monkeypatch.setattr(generations_module, "ADAPTER_HOMES", 2)

    def route(*pairs):
        got = [start(key, adapter) for key, adapter in pairs]
        for key, _ in pairs:
            started[key][2]()
        return got

    assert route(("h1", "p"), ("h2", "p"), ("h3", "d")) == [0, 0, 1]  # d to r1: r0 is full
    assert route(("h4", "q"), ("h5", "d")) == [1, 1]  # d routed again: more recent than q
    assert route(("h6", "d"), ("h7", "d"), ("h8", "s")) == [1, 1, 0]  # s to r0 (r1 full): q forgotten
    assert route(("h9", "d")) == [1]  # d's replica, not the model's last (r0)
    assert route(("h10", "t"), ("h11", "t"), ("h12", "w")) == [1, 1, 0]  # w to r0 (r1 full): d forgotten
    assert route(("h13", "d")) == [0]  # the model's last replica, not d's (r1)
