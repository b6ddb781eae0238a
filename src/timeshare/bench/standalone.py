"""The baselines of ``bench switch`` that do without timeshare, each a plain process
started with ``python -m timeshare.bench.standalone``. They talk to the benchmark by
lines on stdin/stdout:

    train TRAIN BATCH DEVICE
        trains TRAIN (a zoo model) forever; prints "training" after its first iteration.
        Stop-and-start kills it.
    serve MODEL BATCH DEVICE DTYPE OUT
        what a fresh process pays before its first answer: import torch, build the model,
        read its weights file, move it to the device, run once; prints "done". Started by
        stop-and-start right after the kill.
    one-process TRAIN TBATCH MODEL BATCH DEVICE DTYPE OUT
        trains, with MODEL's weights already read into host memory (pinned on CUDA) and
        its structure built; prints "training". On the line "go" it stops at the next
        iteration, frees the training state, allocates MODEL on the device, copies its
        weights (``load_state_dict``, unpipelined) and runs once; prints "done".
        PipeSwitch's "one process" baseline (``model.to(device)``).

Both load the weights strictly (``load_strictly``: a missing key is an error, never
uninitialised memory) and, after "done" (outside the timing), save their output to OUT
and print "saved", so that the benchmark compares it bitwise with the ready model's.
"""

from __future__ import annotations

import select
import sys


def _inputs(model: str, batch: int, device, dtype):
    import torch

    from timeshare.models.zoo import get

    inputs = get(model).example_inputs(batch, torch.float32)
    return tuple((t.to(dtype) if t.is_floating_point() else t).to(device) for t in inputs)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainer(train: str, batch: int, device):
    import torch

    from timeshare.models import workloads
    from timeshare.models.zoo import get

    model = get(train).build().to(device).train()
    opt = workloads.sgd(model.parameters())
    data = workloads.synthetic_batches(train, batch)
    inputs = tuple(t.to(device) for t in next(data))

    def step():
        workloads.synthetic_step(model, opt, inputs)
        _sync(device)

    def free():
        nonlocal model, opt
        del model, opt
        import gc

        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    return step, free


def _save(out, path: str) -> None:
    """The output, on the host, for the benchmark to compare (after the timing)."""
    import torch

    from timeshare.tree import tensors_in

    torch.save([t.detach().cpu() for t in tensors_in(out)], path)  # plain tensors: torch.load needs no trust
    _say("saved")


def _say(word: str) -> None:
    sys.stdout.write(word + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    mode, *rest = argv
    import torch  # noqa: F401  (part of what a fresh process pays)

    from timeshare.device import resolve_device
    from timeshare.dtypes import parse_dtype

    if mode == "train":
        train, batch, device = rest[0], int(rest[1]), resolve_device(rest[2])
        step, _ = _trainer(train, batch, device)
        step()
        _say("training")
        while True:
            step()
    elif mode == "serve":
        from timeshare.models.weights import load_strictly, read_weights
        from timeshare.models.zoo import get, weights_path

        name, batch, device, dtype = rest[0], int(rest[1]), resolve_device(rest[2]), parse_dtype(rest[3])
        model = get(name).build()
        load_strictly(model, read_weights(str(weights_path(name))), name)
        model = model.to(device=device, dtype=dtype).eval()
        with torch.no_grad():
            out = model(*_inputs(name, batch, device, dtype))
        _sync(device)
        _say("done")
        _save(out, rest[4])
    elif mode == "one-process":
        from timeshare.models.weights import load_strictly, read_weights
        from timeshare.models.zoo import get, weights_path

        train, tbatch = rest[0], int(rest[1])
        name, batch, device, dtype = rest[2], int(rest[3]), resolve_device(rest[4]), parse_dtype(rest[5])
        out_path = rest[6]
        host = {k: v.to(dtype) if v.is_floating_point() else v
                for k, v in read_weights(str(weights_path(name))).items()}
        if device.type == "cuda":
            host = {k: v.pin_memory() for k, v in host.items()}
        with torch.device("meta"):
            model = get(name).build()
        model = model.to(dtype).eval()
        inputs = _inputs(name, batch, device, dtype)
        step, free = _trainer(train, tbatch, device)
        step()
        _say("training")
        while not select.select([sys.stdin], [], [], 0)[0]:
            step()
        sys.stdin.readline()
        free()
        model = model.to_empty(device=device)
        load_strictly(model, host, name)
        with torch.no_grad():
            out = model(*inputs)
        _sync(device)
        _say("done")
        _save(out, out_path)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
