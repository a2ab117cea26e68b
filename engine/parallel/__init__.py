"""Tensor parallelism on one host: rank 0's side (`tensor_parallel.py`: the process group, the
workers it starts, the messages it sends), a worker rank (`worker.py`), how the ranks meet and
sum (`collectives.py`, both sides), and the shared-memory all-reduce (`shm_allreduce.py`).
Imports `models/` (the shard plan) and the runner."""
