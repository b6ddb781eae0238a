"""Workers: the logic that executes models on the device (``Worker``), usable in the
caller's process or inside a worker process.

- ``worker``: the ``Worker`` (models, running, first loads, its host stores and their
  page-locking, binding a model where its block is, profiles of a resident model);
- ``loading``: pipelined loading (``WorkerModel``, ``LoadPlan``, the forward that waits per group);
- ``profiling``: profiles, the link's costs, tensor owners for tracing;
- ``trainer``: training iterations (``TrainingTask``) and, in a worker process, a training
  segment's loop (``run_segment``);
- ``proc``: the worker process's loop, ``WorkerProcess``, a method per message (runs in the
  worker), with ``call_tensors`` (a call's tensors in the channel there);
- ``channel``: the per-worker shared-memory tensor channel (NOTE [Tensor channel]), whose
  controller's end is ``executor/handle.py``.
"""
