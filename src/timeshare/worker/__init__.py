"""Workers: the logic that executes models on the device (``Worker``), usable in the
caller's process or inside a worker process.

- ``worker``: the ``Worker`` (models, running, first loads), over ``host_stores`` (its
  stores and their page-locking), ``placement`` (binding a model where its block is) and
  ``resident_profiling`` (profiles of a resident model);
- ``loading``: pipelined loading (``WorkerModel``, ``LoadPlan``, the forward that waits per group);
- ``profiling``: profiles, the link's costs, tensor owners for tracing;
- ``trainer``: training iterations (``TrainingTask``) and, in a worker process, a training
  segment's loop (``run_segment``);
- ``proc``: the worker process's loop, ``WorkerProcess``, a method per message (runs in the
  worker), with ``call_tensors`` (a call's tensors in the channel there);
- ``batch`` and ``generation``: a language model's decode batch, and the batches a worker
  process keeps;
- ``channel``: the per-worker shared-memory tensor channel (NOTE [Tensor channel]), whose
  controller's end is ``executor/handle.py``.
"""
