"""Resolving the compute device, once. Runs in every process.

``resolve_device`` is the only place that asks whether CUDA exists; everything else
receives a ``torch.device``. Importing this module never initializes CUDA.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from timeshare.errors import ConfigError, DeviceError

log = logging.getLogger(__name__)

_KNOWN = ("auto", "cpu", "cuda")


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """Turn "auto" | "cpu" | "cuda" | "cuda:N" into a concrete ``torch.device``.

    "auto" picks the first CUDA device when one is usable, else the CPU. Asking for
    CUDA on a machine without it is a :class:`DeviceError`, never a silent fallback.
    """
    if isinstance(spec, torch.device):
        text = str(spec)
    elif isinstance(spec, str):
        text = spec.strip().lower()
    else:
        raise ConfigError(f"device must be one of {_KNOWN} or 'cuda:N', got {spec!r}")
    if text == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text.startswith("cuda"):
        try:
            dev = torch.device(text)
        except RuntimeError as exc:
            raise ConfigError(f"device {spec!r} is not a valid CUDA device name") from exc
        if not torch.cuda.is_available():
            raise DeviceError(f"device {spec!r} was requested but CUDA is not available on this machine")
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise DeviceError(
                f"device {spec!r} was requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
        return torch.device("cuda", index)
    raise ConfigError(f"device must be one of {_KNOWN} or 'cuda:N', got {spec!r}")


def synchronize(device: torch.device) -> None:
    """Wait until all work queued on ``device`` has finished (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# NOTE [A core for the front end]
# A server on the CPU leaves its front end (HTTP, tokenizers, the engines' bookkeeping) a
# core while its language models decode, as vLLM's CPU backend reserves one for its API
# server: decode steps compute with every core but one (at least one), prefills and
# everything else with every core. ``OMP_NUM_THREADS`` set by the user wins. In a worker
# process of the server, whose only thread that computes is the one running the steps, a
# decode step of at least ``WIDE_DECODE_ROWS`` rows uses every core again; in the server's
# own process (``workers: 0``) no decode step does.
# Why: GNU OpenMP (PyTorch's on Linux) lets a team's threads spin between parallel
# regions, unless the process has more OpenMP threads than cores: then they sleep after
# about a hundred spins (``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` do not change that).
# The server's own process has several threads that compute (the engines, the loader,
# request threads), each with its own team, so every small operator of a decode step paid
# a sleep and a wake: the 9 MiB Llama of ``bench llm --peer`` decoded one request at 170
# tokens/s with 41,000 context switches of the engine's thread in 10 s, on one core at
# 345, eight requests at 1,000 and 1,550 (2-core VM, in-process). A worker's one team does
# spin, but two spinning threads and the server's front end then share two cores, and the
# scheduler takes the core of a spinning thread that its team waits for: one request at
# 329 and 384 tokens/s on two cores, 425 and 478 on one (two alternated rounds); four at
# 925 and 1,062 (one round); eight, where a step's arithmetic is worth a second core, at
# 2,087 and 1,973 on two, 1,711 and 1,700 on one (two rounds). A prefill's few large
# operators hardly notice the teams: a 1,500-token prompt took 195 ms on one core where two
# take 142.
WIDE_DECODE_ROWS = 8
_step_threads: tuple[int, int, int] | None = None  # a prefill's, a narrow decode step's and a wide one's


def leave_a_core(one_team: bool = False) -> None:
    """This process serves (or is a worker of a server: ``one_team``): language models'
    steps on the CPU compute as NOTE [A core for the front end] says, from PyTorch's thread
    count now, unless the user set ``OMP_NUM_THREADS``."""
    global _step_threads
    if "OMP_NUM_THREADS" in os.environ:
        return
    threads = torch.get_num_threads()
    fewer = max(1, threads - 1)
    _step_threads = (threads, fewer, threads if one_team else fewer)


@contextmanager
def as_served() -> Iterator[None]:
    """Inside the block, language models' steps on the CPU compute as a server's do (NOTE
    [A core for the front end]): for a bench that measures what ``timeshare serve`` does;
    the thread counts are put back after."""
    global _step_threads
    before, threads = _step_threads, torch.get_num_threads()
    leave_a_core()
    try:
        yield
    finally:
        _step_threads = before
        torch.set_num_threads(threads)


def leaves_a_core() -> bool:
    """Whether this process leaves a core to a front end (its workers do as it does)."""
    return _step_threads is not None


def step_threads(device: torch.device, decode: bool, rows: int) -> None:
    """This thread's cores for a language model's step of ``rows`` rows, a prefill or a
    decode step, in a process that leaves a core to a front end (else unchanged)."""
    if _step_threads is not None and device.type == "cpu":
        threads = _step_threads[(2 if rows >= WIDE_DECODE_ROWS else 1) if decode else 0]
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


# NOTE [Current device]
# CUDA calls that take no device act on the process's current one, cuda:0 unless set:
# the runtime API behind ``torch.cuda.cudart()`` (cudaHostRegister), and torch's own
# ``synchronize()``, ``current_stream()``, ``Stream()``, ``manual_seed()`` when called
# without a device. A call on a device without a context creates one there (hundreds of
# MB). So timeshare passes its device to every such call, and:
# - a worker process computes on one device only: it makes that device current before
#   its first CUDA call (``make_current``), so its context, the arena's IPC mapping and
#   its host registrations all live there, and nothing touches cuda:0 on a cuda:1 run;
# - the controller runs in the caller's process, whose current device is the caller's
#   business: it never changes it, and guards the calls that have no device argument
#   (``CudaHostRegistrar``).
def make_current(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device; a no-op on the CPU. Only
    for a process of timeshare's own (a worker): NOTE [Current device]."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


# NOTE [Exact host pinning]
# Host memory that the device reads asynchronously (a host store, a worker's input
# staging buffer) is a plain allocation of exactly its size, page-locked with
# cudaHostRegister, never a block of PyTorch's caching host allocator
# (``pin_memory=True``): that one rounds every block up to a power of two (a 70 MB store
# would lock 128 MB) and keeps freed blocks locked in its cache. Whoever registers a
# range unregisters it, after the last copy from it has finished and before the memory
# is freed (``HostPin`` in transfer/host_store.py), and the bytes are counted where they
# were registered, so the pinned-bytes metric reports what is locked. Under a host budget
# a store is locked only while its pages hold bytes (NOTE [Locked host tier] in
# transfer/backing.py).
class HostRegistrar(Protocol):
    """Page-locks host memory for a device's copies (a fake stands in for it in tests)."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` bytes at ``ptr``; raises if that fails."""

    def unregister(self, ptr: int) -> None:
        """Undo ``register(ptr, ...)``. Never raises: it runs from finalizers."""


CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every context of the process


class CudaHostRegistrar:
    """cudaHostRegister and cudaHostUnregister, with ``device`` current during the call
    (NOTE [Current device]). Registered portable: the pages are locked for every CUDA
    context of the process, whichever device made the call."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise DeviceError(f"host memory is page-locked for a CUDA device, not {device}")
        self.device = device

    def register(self, ptr: int, nbytes: int) -> None:
        with torch.cuda.device(self.device):
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE))
        if err != 0:
            clear_cuda_error()
            raise DeviceError(f"cannot page-lock {nbytes:,} bytes of host memory for {self.device}: "
                              f"cudaHostRegister failed with CUDA error {err}")

    def unregister(self, ptr: int) -> None:
        try:
            with torch.cuda.device(self.device):
                err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        except RuntimeError as exc:  # CUDA itself is broken now (a sticky error): nothing to give back
            log.warning("cudaHostUnregister(0x%x) failed: %s", ptr, exc)
            return
        if err != 0:
            clear_cuda_error()
            log.warning("cudaHostUnregister(0x%x) failed with CUDA error %d", ptr, err)


def clear_cuda_error() -> None:
    """Consume the CUDA runtime's pending error after a failed call that was handled.
    A failed runtime call leaves its error pending for the thread, and PyTorch checks
    ``cudaGetLastError()`` after every kernel launch: the next unrelated launch would fail
    with it. torch's cudart binding has no ``cudaGetLastError``, so it is called in every
    CUDA runtime library this process loaded (opening a loaded library again returns
    the same instance). Best effort: a runtime linked statically cannot be reached."""
    try:
        with open("/proc/self/maps") as f:
            paths = loaded_cudart(f)
    except OSError:
        return
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError) as exc:
            log.debug("cannot clear the CUDA error through %s: %s", path, exc)


def loaded_cudart(maps: Iterable[str]) -> list[str]:
    """The CUDA runtime libraries among the lines of a ``/proc/<pid>/maps``: torch wheels
    bundle them as ``libcudart-<hash>.so.N``; a replaced file reads "(deleted)"."""
    paths: list[str] = []
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].strip().removesuffix(" (deleted)")
        if os.path.basename(path).startswith("libcudart") and path not in paths:
            paths.append(path)
    return paths


def host_registrar(device: torch.device) -> HostRegistrar | None:
    """What page-locks host memory for ``device``: None on the CPU, where nothing needs it."""
    return CudaHostRegistrar(device) if device.type == "cuda" else None


# NOTE [Deterministic kernels]
# A bitwise claim about training (a packed job ends with the weights it has alone) means
# something only where the same job run twice ends with the same bits. On CUDA it need
# not: by default cuDNN may pick backward algorithms that accumulate with atomics, so the
# order of the additions, and the last bits of the weights, change from run to run.
# Deterministic kernels take three switches in every process that computes:
# ``torch.use_deterministic_algorithms(True)`` (an operator with no deterministic kernel
# then raises instead of running), cuDNN deterministic with benchmarking off, and
# CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment. PyTorch reads the last once, at
# the process's first cuBLAS call (a process that used cuBLAS without it raises on every
# cuBLAS call once deterministic algorithms are on), so it is set before the process
# first computes on CUDA: worker processes inherit it at spawn and apply it again with
# the other flags (``BackendFlags``) before their first kernel.
CUBLAS_WORKSPACE_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the values PyTorch accepts as deterministic


# The objects whose ``fp32_precision`` (PyTorch's newer TF32 API) selects the kernels'
# float32 arithmetic, parents before children: setting a parent can reset its children.
_PRECISION_PATHS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn",
                    "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _backend(path: str):
    obj = torch.backends
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class BackendFlags:
    """The numerics switches of PyTorch's backends that change a kernel's result bits:
    TF32 for matmul and cuDNN (``fp32_precision`` per backend where PyTorch has it, else
    the legacy ``allow_tf32`` flags and the float32 matmul precision), cuDNN's
    deterministic and benchmark modes, reduced-precision reductions, deterministic
    algorithms and the cuBLAS workspace configuration they need on CUDA (NOTE
    [Deterministic kernels]). A worker process starts with PyTorch's defaults; the
    runtime captures the creating process's flags and every worker applies them before
    its first kernel, so a worker computes the same bits as the process that created the
    runtime. Reading and setting them never initializes CUDA."""

    cudnn_benchmark: bool
    cudnn_deterministic: bool
    matmul_allow_fp16_reduced: bool
    matmul_allow_bf16_reduced: bool
    deterministic_algorithms: bool
    deterministic_warn_only: bool
    precisions: tuple[tuple[str, str], ...] = ()  # (backend path, fp32_precision), newer PyTorch
    legacy: tuple[bool, bool, str] | None = None  # (cudnn allow_tf32, matmul allow_tf32, matmul precision)
    cublas_workspace_config: str | None = None  # the environment's CUBLAS_WORKSPACE_CONFIG (None: unset)

    @classmethod
    def capture(cls) -> BackendFlags:
        m = torch.backends.cuda.matmul
        precisions: tuple[tuple[str, str], ...] = ()
        legacy = None
        if hasattr(torch.backends.cudnn, "fp32_precision"):
            precisions = tuple((p, str(_backend(p).fp32_precision)) for p in _PRECISION_PATHS
                               if hasattr(_backend(p), "fp32_precision"))
        else:
            legacy = (bool(torch.backends.cudnn.allow_tf32), bool(m.allow_tf32), torch.get_float32_matmul_precision())
        return cls(
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
            cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
            matmul_allow_fp16_reduced=bool(m.allow_fp16_reduced_precision_reduction),
            matmul_allow_bf16_reduced=bool(m.allow_bf16_reduced_precision_reduction),
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            precisions=precisions,
            legacy=legacy,
            cublas_workspace_config=os.environ.get(CUBLAS_WORKSPACE_VARIABLE),
        )

    def apply(self) -> None:
        for path, value in self.precisions:
            _backend(path).fp32_precision = value
        if self.legacy is not None:
            cudnn_tf32, matmul_tf32, precision = self.legacy
            torch.set_float32_matmul_precision(precision)  # first: it also sets matmul TF32
            torch.backends.cudnn.allow_tf32 = cudnn_tf32
            torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        m = torch.backends.cuda.matmul
        m.allow_fp16_reduced_precision_reduction = self.matmul_allow_fp16_reduced
        m.allow_bf16_reduced_precision_reduction = self.matmul_allow_bf16_reduced
        torch.use_deterministic_algorithms(self.deterministic_algorithms, warn_only=self.deterministic_warn_only)
        # Read by PyTorch and cuBLAS at this process's first cuBLAS call: a worker applies
        # the flags before its first kernel (NOTE [Deterministic kernels]).
        if self.cublas_workspace_config is None:
            os.environ.pop(CUBLAS_WORKSPACE_VARIABLE, None)
        else:
            os.environ[CUBLAS_WORKSPACE_VARIABLE] = self.cublas_workspace_config


@contextmanager
def cublas_workspace_deterministic() -> Iterator[str]:
    """Run a block with CUBLAS_WORKSPACE_CONFIG at a deterministic value (:4096:8, unless
    it has one already), put back as it was afterwards. Enter it before this process's
    first cuBLAS call (NOTE [Deterministic kernels])."""
    before = os.environ.get(CUBLAS_WORKSPACE_VARIABLE)
    if before not in CUBLAS_DETERMINISTIC:
        os.environ[CUBLAS_WORKSPACE_VARIABLE] = CUBLAS_DETERMINISTIC[0]
    try:
        yield os.environ[CUBLAS_WORKSPACE_VARIABLE]
    finally:
        if before is None:
            os.environ.pop(CUBLAS_WORKSPACE_VARIABLE, None)
        else:
            os.environ[CUBLAS_WORKSPACE_VARIABLE] = before


@contextmanager
def deterministic_kernels() -> Iterator[dict]:
    """Run a block with deterministic kernels (NOTE [Deterministic kernels]) in this process
    and in the worker processes of every runtime created in it; the flags and the
    environment as they were are put back afterwards. Yields ``kernel_settings()``."""
    before = BackendFlags.capture()
    with cublas_workspace_deterministic():
        try:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
            yield kernel_settings()
        finally:
            before.apply()


def kernel_settings() -> dict:
    """This process's switches that decide whether its kernels are deterministic, for a
    benchmark's record (NOTE [Deterministic kernels])."""
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cublas_workspace_config": os.environ.get(CUBLAS_WORKSPACE_VARIABLE),
    }
