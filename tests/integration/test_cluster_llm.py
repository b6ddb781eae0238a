"""NOTE [Language models on a cluster], without Ray: a replica's generations (a cancel
that arrives before its generation is not lost), and the front end's relay of a stream
(the token count of a generation cut short, an error that is the replica's own)."""

from __future__ import annotations

import pytest

from timeshare.cluster.llm import LLMDef, RemoteEngine, RemoteGeneration, relay
from timeshare.cluster.replica import Replica
from timeshare.errors import Timeout
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
    def llm_snapshots(self, name):
        return []


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
