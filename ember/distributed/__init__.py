"""Several devices per engine: the process group (`state`), the collectives the parallel layers
call (`comm`), and how a dimension splits across ranks (`shard`).

An engine with `tensor_parallel_size` N runs one process a device (rank 0 is the engine core's
own; ember/engine/workers.py starts the others). The models read the rank and size from
`state.current()` while they are built, as vLLM's layers read its parallel state: a one-device
engine sees rank 0 of 1, and every collective is then a no-op, so the one-device path is the same
code."""
