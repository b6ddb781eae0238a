"""NOTE [Masks while the device runs]: a step's grammar masks are computed after its
forward is queued (in-process) or its step posted to the worker (with workers), are the
ones applied, and a mask that cannot be computed fails the step and nothing after it."""

from __future__ import annotations

import json

import pytest

from tests.llm_reference import with_pools
from timeshare import protocol as P
from timeshare.decode import runner
from timeshare.executor.handle import WorkerHandle
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.constrained import LLGuidance, OutputFormat
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.facade import Runtime

transformers = pytest.importorskip("transformers")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return hfdir.write_model_dir(tmp_path_factory.mktemp("late") / "llama", "llama", seed=9, hidden=64, layers=2)


class _Recorded:
    """A matcher whose masks are recorded in ``events`` (and fail while ``fail`` holds)."""

    def __init__(self, inner, events: list[str], fail: list[bool]):
        self._inner, self._events, self._fail = inner, events, fail

    def mask(self) -> bytes:
        self._events.append("mask")
        if self._fail and self._fail[0]:
            raise RuntimeError("the grammar library failed")
        return self._inner.mask()

    def accept(self, token: int) -> bool:
        return self._inner.accept(token)

    def done(self) -> bool:
        return self._inner.done()


@pytest.fixture(params=[0, 2], ids=["in-process", "workers"])
def recorded(request, llama, monkeypatch):
    """A constrained model whose masks, and whose forwards (in-process) or steps posted to
    the worker (with workers), are recorded in order."""
    events: list[str] = []
    fail: list[bool] = [False]

    class Recording(LLGuidance):
        def matcher(self, fmt):
            return _Recorded(super().matcher(fmt), events, fail)

    monkeypatch.setattr(lm, "LLGuidance", Recording)
    if request.param:
        sent = WorkerHandle.post_bytes

        def post_bytes(self, data):
            msg = P.loads(data)
            if isinstance(msg, P.RunModel) and msg.step is not None:
                events.append("sent")
            return sent(self, data)

        monkeypatch.setattr(WorkerHandle, "post_bytes", post_bytes)
    else:
        forward = transformers.LlamaForCausalLM.forward

        def recorded_forward(self, *args, **kwargs):
            events.append("sent")
            return forward(self, *args, **kwargs)

        monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", recorded_forward)
        lean = runner.lean_logits

        def recorded_lean(*args, **kwargs):  # NOTE [Lean decode steps]: decode steps without forward
            events.append("sent")
            return lean(*args, **kwargs)

        monkeypatch.setattr(runner, "lean_logits", recorded_lean)
    with Runtime("cpu", with_pools("16MiB", [llama], max_context=128), workers=request.param) as rt:
        yield lm.load(rt, "llama", llama, max_context=128, max_sequences=4), events, fail


def test_each_steps_masks_are_computed_after_its_forward_is_on_its_way(recorded):
    model, events, _ = recorded
    params = SamplingParams(max_tokens=60, temperature=0, output=OutputFormat.json_schema(SCHEMA))
    done = model.generate(model.encode("answer"), params).result(60)
    assert json.loads(done.text)["b"] in ("x", "y")
    masks = [i for i, e in enumerate(events) if e == "mask"]
    assert len(masks) >= len(done.tokens) - 1
    for before, at in zip([-1] + masks, masks):  # one forward (or step sent) between masks
        assert "sent" in events[before + 1:at], " ".join(events)


def test_a_mask_that_fails_fails_its_step_and_the_next_request_is_answered(recorded):
    model, _, fail = recorded
    params = SamplingParams(max_tokens=60, temperature=0, output=OutputFormat.json_schema(SCHEMA))
    # Greedy, so that the request after the failure is compared with the same one before it
    # (a sampled one could draw the end of text at once: seen in CI).
    plain_params = SamplingParams(max_tokens=5, temperature=0)
    want = model.generate(model.encode("answer"), plain_params).result(60).tokens
    assert len(want) == 5  # not the end of text: a grammar's mask left behind would show
    fail[0] = True
    with pytest.raises(Exception, match="grammar library failed"):
        model.generate(model.encode("answer"), params).result(60)
    fail[0] = False
    done = model.generate(model.encode("answer"), params).result(60)
    assert set(json.loads(done.text)) == {"a", "b"}
    assert model.generate(model.encode("answer"), plain_params).result(60).tokens == want
