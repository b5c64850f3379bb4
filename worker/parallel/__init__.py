"""Tensor parallelism inside one worker: which slice each rank holds (shard.py), the parallel
layers that hold it (layers.py), their all-reduce (communicator.py), the process group
(group.py) and the rank processes (ranks.py). docs/tensor-parallel.md tells the whole story."""
