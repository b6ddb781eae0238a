"""The device side of a language model's step (NOTE [One step, two places] in ``step.py``):
its pages (``pages.py``), the adapter over ``transformers``' caches (``cache.py``), the
one sampler (``sampler.py``) and the runner with its graphs (``runner.py``). Runs where
the model's weights are: the controller for an in-process runtime, a worker process with
workers. Imports nothing of the runtime or of ``llm``."""
