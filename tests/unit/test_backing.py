"""The disk tier's pieces (NOTE [Host tier], NOTE [Disk to device]): a safetensors index
from the header alone, damaged files refused, reads streamed into a store while a copy
engine follows them."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from timeshare.errors import WeightsError
from timeshare.transfer import disk
from timeshare.transfer.backing import HostPages
from timeshare.transfer.copy import CpuCopyEngine
from timeshare.transfer.disk import FillSpec, SafetensorsIndex, StreamFill


def test_the_index_matches_what_safetensors_reads(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=g), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(4, generator=g).to(torch.bfloat16)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    index = SafetensorsIndex.read(path)
    raw = path.read_bytes()
    for name, t in tensors.items():
        ft = index.tensors[name]
        assert ft.dtype == t.dtype and ft.shape == tuple(t.shape)
        got = torch.frombuffer(bytearray(raw[ft.start:ft.end]), dtype=torch.uint8).view(t.dtype).view(t.shape)
        assert torch.equal(got, t)
    index.check()


def test_one_index_over_shards_reads_each_tensor_from_its_file(tmp_path):
    g = torch.Generator().manual_seed(1)
    parts = [{"a": torch.randn(6, generator=g)}, {"b": torch.randn(2, 3, generator=g), "c": torch.ones(5)}]
    paths = []
    for i, part in enumerate(parts):
        paths.append(tmp_path / f"model-{i}.safetensors")
        save_file(part, str(paths[-1]))
    index = SafetensorsIndex.read_many(paths)
    assert index.paths == tuple(paths) and index.path == paths[0]
    for i, part in enumerate(parts):
        raw = paths[i].read_bytes()
        for name, t in part.items():
            ft = index.tensors[name]
            assert ft.file == i
            assert torch.equal(torch.frombuffer(bytearray(raw[ft.start:ft.end]), dtype=torch.uint8).view(t.dtype)
                               .view(t.shape), t)
    # The streamed fill of a store laid out across both files.
    pieces = ((1, index.tensors["b"].start, 0, 24), (0, index.tensors["a"].start, 24, 24))
    spec = FillSpec(tuple(map(str, paths)), pieces, 48)
    buf = torch.zeros(48, dtype=torch.uint8)
    stream = StreamFill(spec, buf, chunk=8).start()
    stream.wait_all()
    stream.close()
    assert torch.equal(buf[:24].view(torch.float32).view(2, 3), parts[1]["b"])
    assert torch.equal(buf[24:].view(torch.float32), parts[0]["a"])
    index.check()
    paths[1].write_bytes(paths[1].read_bytes()[:-4])
    with pytest.raises(WeightsError, match="model-1.safetensors"):
        index.check()
    save_file({"a": torch.zeros(1)}, str(tmp_path / "again.safetensors"))
    with pytest.raises(WeightsError, match="in two shards"):
        SafetensorsIndex.read_many([paths[0], tmp_path / "again.safetensors"])


@pytest.mark.parametrize("content", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{}", b"\xff" * 16,
                                     b"\x08\x00\x00\x00\x00\x00\x00\x00notjson!"])
def test_a_file_that_is_not_safetensors_is_refused_clearly(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(WeightsError, match="bad.safetensors"):
        SafetensorsIndex.read(path)


def test_a_header_whose_ranges_overrun_the_file_is_refused(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(100)}, str(path))
    os.truncate(path, os.path.getsize(path) - 8)
    with pytest.raises(WeightsError, match="do not fit"):
        SafetensorsIndex.read(path)


def test_dropped_pages_read_as_zeros_and_are_given_back():
    pages = HostPages(8 << 20)
    pages.tensor.fill_(7)
    held = pages.resident_bytes()
    assert held is not None and held >= 8 << 20
    pages.drop()
    assert pages.resident_bytes() < 64 << 10
    assert int(pages.tensor.max()) == 0


def _slow_reads(monkeypatch):
    real = os.preadv

    def slow(fd, buffers, offset):
        import time
        time.sleep(0.002)
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk.os, "preadv", slow)


def test_copies_follow_the_reads_group_by_group(tmp_path, monkeypatch):
    n = 1 << 20
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "store.bin"
    path.write_bytes(b"H" * 4096 + data.numpy().tobytes())
    _slow_reads(monkeypatch)  # about 0.5 s of reads: a copy that did not wait would copy zeros
    src, dst = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    stream = StreamFill(FillSpec.one(str(path), ((4096, 0, n),), n), src, threads=2, chunk=4096).start()
    engine = CpuCopyEngine(deadline_s=30)
    try:
        groups = [(i, min(i + (n // 8), n)) for i in range(0, n, n // 8)]
        load = engine.start(src, dst, groups, "test", ready=stream.wait_until)
        load.wait_all()
        stream.wait_all()
        assert torch.equal(dst, data) and torch.equal(src, data)
        assert stream.bytes_read == n and stream.read_s > 0
    finally:
        stream.close()
        engine.close()


def test_a_file_cut_short_fails_the_reads_that_need_the_missing_bytes(tmp_path):
    path = tmp_path / "store.bin"
    path.write_bytes(bytes(4096 + 100_000))
    buf = torch.zeros(200_000, dtype=torch.uint8)
    stream = StreamFill(FillSpec.one(str(path), ((4096, 0, 200_000),), 200_000), buf, chunk=50_000).start()
    try:
        stream.wait_until(50_000)  # the bytes that are there are read
        with pytest.raises(WeightsError, match="truncated"):
            stream.wait_all()
        assert isinstance(stream.error, WeightsError)
    finally:
        stream.close()


def test_a_load_from_disk_is_planned_for_the_slower_of_disk_and_link():
    from timeshare.transfer.planner import first_inference_time, make_plan
    from timeshare.transfer.profiler import LinkCosts, ModelProfile

    layer_bytes = [8 << 20] * 12
    profile = ModelProfile("m", "cpu", "k", [f"l{i}" for i in range(12)], layer_bytes, [0.004] * 12,
                           LinkCosts(bandwidth_Bps=20e9, alpha_s=1e-5, beta_s=1e-6), 0.048, 0, {})
    assert profile.cost_model(1e9).transfer[0] == pytest.approx((8 << 20) / 1e9)  # the disk is slower
    assert profile.cost_model(40e9).transfer == profile.cost_model().transfer  # the link is
    slow = profile.cost_model(1e9)
    on_disk, for_link = make_plan("optimal", slow, layer_bytes), make_plan("optimal", profile.cost_model(), layer_bytes)
    # The plan made for the link is not the best one when the bytes come from disk.
    best = first_inference_time(slow, on_disk.ends)
    assert best < first_inference_time(slow, for_link.ends) * 0.9
    for other in ("per_layer", "whole"):
        assert best <= first_inference_time(slow, make_plan(other, slow, layer_bytes).ends)


@pytest.mark.parametrize("direct", [True, False])
def test_reads_at_unaligned_offsets_give_the_file_bytes_directly_or_buffered(tmp_path, direct):
    data = torch.randint(0, 256, (3 * disk.DIRECT_ALIGN + 777,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(1))
    path = tmp_path / "w.bin"
    path.write_bytes(data.numpy().tobytes())
    reader = disk.FileReader(path, direct=direct)
    try:
        # O_DIRECT where the file system allows (NOTE [Direct reads]); a test machine
        # on ext4 or xfs does, and the reads must then have bypassed the page cache.
        assert reader.direct == (direct and hasattr(os, "O_DIRECT") and _supports_direct(tmp_path))
        for offset, n in [(0, 10), (5, disk.DIRECT_ALIGN), (4095, 2), (disk.DIRECT_ALIGN, 2 * disk.DIRECT_ALIGN),
                          (len(data) - 300, 300), (1, len(data) - 1)]:
            out = bytearray(n)
            reader.read(offset, memoryview(out))
            assert bytes(out) == data[offset:offset + n].numpy().tobytes(), (offset, n)
        # Still direct after them: a misaligned direct read would have fallen back (EINVAL)
        # and given the right bytes all the same.
        assert reader.direct == (direct and hasattr(os, "O_DIRECT") and _supports_direct(tmp_path))
        with pytest.raises(WeightsError, match="truncated"):
            reader.read(len(data) - 10, memoryview(bytearray(20)))
    finally:
        reader.close()


def _supports_direct(folder) -> bool:
    try:
        fd = os.open(folder / "w.bin", os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def test_a_file_system_that_refuses_direct_reads_falls_back_to_buffered(tmp_path, monkeypatch):
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(256)) * 64)
    if not _supports_direct(tmp_path):
        pytest.skip("this file system does not open files with O_DIRECT")
    reader = disk.FileReader(path, direct=True)
    assert reader.direct
    real = os.preadv

    def refuse_direct(fd, buffers, offset):
        if reader.direct:
            raise OSError(22, "Invalid argument")  # EINVAL, as tmpfs answers O_DIRECT
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk.os, "preadv", refuse_direct)
    try:
        out = bytearray(1000)
        reader.read(300, memoryview(out))
        assert bytes(out) == (bytes(range(256)) * 64)[300:1300] and not reader.direct
    finally:
        reader.close()
