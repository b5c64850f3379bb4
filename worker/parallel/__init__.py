"""Tensor parallelism inside one worker: which slice each rank holds (shard.py), the parallel
layers that hold it (layers.py), their all-reduce (communicator.py) and the process group
(group.py). The rank processes that run them are the executor's (worker/executor/tp_ranks.py).
docs/tensor-parallel.md tells the whole story."""
