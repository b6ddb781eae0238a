import pytest
import torch
from safetensors.torch import save_file

from tests import models
from timeshare.errors import WeightsError
from timeshare.models.binding import bind, collect, unbind
from timeshare.models.weights import apply_weights, read_weights, save_weights
from timeshare.models.zoo.small import TiedLM
from timeshare.transfer.host_store import HostStore


def test_tied_weights_are_one_entry_with_all_names():
    m = TiedLM()
    layout = collect(m)
    tied = [e for e in layout.entries if len(e.names) > 1]
    assert [e.names for e in tied] == [("embed.weight", "decoder.weight")]
    assert len(layout.entries) == len({id(t) for t in m.state_dict(keep_vars=True).values()})


def test_bind_keeps_ties_and_unbind_leaves_only_meta():
    m = TiedLM()
    layout = collect(m)
    new = {e.key: torch.full(e.shape, 1.0).to(e.dtype) for e in layout.entries}
    key_of = bind(layout, new)
    assert m.decoder.weight is m.embed.weight
    assert isinstance(m.embed.weight, torch.nn.Parameter)
    assert m.embed.weight.data_ptr() == new["embed.weight"].data_ptr()
    assert set(key_of.values()) == {e.key for e in layout.entries}
    unbind(layout)
    assert all(t.is_meta for t in m.state_dict().values())
    assert m.decoder.weight is m.embed.weight


def test_shared_submodule_is_collected_once():
    m = models.shared_submodule()
    layout = collect(m)
    names = {e.key: e.names for e in layout.entries}
    assert names["a.weight"] == ("a.weight", "b.weight")
    assert len(layout.entries) == 4


def test_host_store_packs_aligned_and_round_trips():
    m = models.out_of_order()
    layout = collect(m)
    tensors = layout.tensors()
    store = HostStore.pack(layout.entries, tensors, pin=False, alignment=512)
    assert sorted(e.key for e in store.entries) == sorted(tensors)  # every tensor packed, once
    for e in store.entries:
        assert e.offset % 512 == 0
        assert torch.equal(store.tensor(e.key), tensors[e.key])
    assert store.nbytes % 512 == 0 and not store.pinned


def test_weights_round_trip_through_safetensors(tmp_path):
    src = TiedLM()
    path = save_weights(src, tmp_path / "w.safetensors")
    dst = TiedLM()
    layout = collect(dst)
    got = apply_weights(layout, layout.tensors(), read_weights(path))
    assert torch.equal(got["embed.weight"], src.embed.weight)
    assert torch.equal(got["late.bias"], src.late.bias)


def test_full_state_dict_with_both_tied_names_is_accepted():
    src = TiedLM()
    layout = collect(TiedLM())
    got = apply_weights(layout, layout.tensors(), dict(src.state_dict()))
    assert torch.equal(got["embed.weight"], src.embed.weight)


def _layout_and_state():
    m = models.out_of_order()
    layout = collect(m)
    return layout, {k: v.clone() for k, v in m.state_dict().items()}


def test_missing_tensor_is_named():
    layout, state = _layout_and_state()
    del state["middle.weight"]
    with pytest.raises(WeightsError, match=r"no tensor 'middle.weight' \(parameter, shape \[8, 8\]\)"):
        apply_weights(layout, layout.tensors(), state)


def test_shape_mismatch_is_named():
    layout, state = _layout_and_state()
    state["last.bias"] = torch.zeros(9)
    with pytest.raises(WeightsError, match=r"'last.bias' has shape \[9\] in the weights but \[8\]"):
        apply_weights(layout, layout.tensors(), state)


def test_unexpected_tensor_is_named():
    layout, state = _layout_and_state()
    state["ghost.weight"] = torch.zeros(1)
    with pytest.raises(WeightsError, match="'ghost.weight' that the module does not have"):
        apply_weights(layout, layout.tensors(), state)


def test_dtype_rules():
    layout, state = _layout_and_state()
    state["last.weight"] = state["last.weight"].half()
    got = apply_weights(layout, layout.tensors(), state)
    assert got["last.weight"].dtype == torch.float32  # floats convert
    state["bn.num_batches_tracked"] = torch.zeros((), dtype=torch.float32)
    with pytest.raises(WeightsError, match="'bn.num_batches_tracked' has dtype"):
        apply_weights(layout, layout.tensors(), state)


def test_tied_names_with_different_values_are_rejected():
    src = TiedLM()
    state = {k: v.clone() for k, v in src.state_dict().items()}
    state["decoder.weight"] += 1
    layout = collect(TiedLM())
    with pytest.raises(WeightsError, match="tied tensors"):
        apply_weights(layout, layout.tensors(), state)


def test_non_persistent_buffers_keep_the_module_value():
    m = models.optional_head()
    layout = collect(m)
    state = dict(m.state_dict())
    assert "offset" not in state
    got = apply_weights(layout, layout.tensors(), state)
    assert torch.equal(got["offset"], torch.linspace(-1, 1, 8))


def test_unreadable_files_are_clear_errors(tmp_path):
    with pytest.raises(WeightsError, match="does not exist"):
        read_weights(tmp_path / "nope.safetensors")
    (tmp_path / "w.pt").write_bytes(b"x")
    with pytest.raises(WeightsError, match="not a .safetensors file"):
        read_weights(tmp_path / "w.pt")
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.arange(1000, dtype=torch.float32)}, str(good))
    data = good.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="corrupt or unreadable"):
        read_weights(truncated)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(WeightsError, match="corrupt or unreadable"):
        read_weights(garbage)
    with pytest.raises(WeightsError, match="not a tensor"):
        read_weights({"a": 1})
    with pytest.raises(WeightsError, match="safetensors path, a list of shards or a state dict"):
        read_weights(42)


def test_load_strictly_refuses_a_missing_key_but_not_a_tied_alias():
    from timeshare.models.weights import load_strictly

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(5, 4)
            self.head = torch.nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight  # one tensor, two names

    state = {"emb.weight": Tied().emb.weight.detach().clone()}
    load_strictly(Tied(), state, "tied")  # a weights file names a tied tensor once: not missing
    with pytest.raises(WeightsError, match=r"lin: .*missing \['weight'\]"):
        load_strictly(torch.nn.Linear(4, 5), {"bias": torch.zeros(5)}, "lin")
    with pytest.raises(WeightsError, match=r"unexpected \['extra'\]"):
        load_strictly(torch.nn.Linear(4, 5), {**torch.nn.Linear(4, 5).state_dict(), "extra": torch.ones(1)}, "lin")
    # Built on meta and given storage with to_empty (the one-process baseline), the tie is
    # broken: the alias would be uninitialised memory, and is refused.
    with torch.device("meta"):
        empty = Tied()
    empty = empty.to_empty(device="cpu")
    assert empty.head.weight is not empty.emb.weight
    with pytest.raises(WeightsError, match="head.weight"):
        load_strictly(empty, state, "tied")
