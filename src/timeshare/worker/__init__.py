"""Workers: the logic that executes models on the device (``Worker``), usable in the
caller's process or inside a worker process."""
