"""Workers: the logic that executes models on the device (``Worker``), usable in the
caller's process or inside a worker process.

- ``worker``: the ``Worker`` (models, running, binding, first loads);
- ``loading``: pipelined loading (``WorkerModel``, ``LoadPlan``, the forward that waits per group);
- ``profiling``: profiles, the link's costs, tensor owners for tracing;
- ``trainer``: training iterations (``TrainingTask``);
- ``proc``: the worker process's loop (runs in the worker);
- ``handle``: the controller's end of a worker process (``WorkerHandle``, runs in the controller).
"""
