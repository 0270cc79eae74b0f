"""Tensor parallelism: the model's heads, KV heads and MLP split over processes, one per device.

`shard` says which slice of each weight a rank holds; `group` is rank 0's side (start the workers, send
each step, all-reduce, notice a dead rank); `worker` is every other rank's process. Kept import-light:
the loader imports `shard`, and only an engine with tensor_parallel_size > 1 imports `group`.
"""
