"""Moving weights from host to device: the packed host store, the per-layer profile,
the grouping planner and the pipelined copy engines."""
