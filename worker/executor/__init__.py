"""Runs one scheduled step on the device: the model runner, the decode CUDA graphs, pinned host
staging, the step's batch as the scheduler hands it over (scheduled_batch.py), and the
processes of the other tensor-parallel ranks, which run the same step (tp_ranks.py)."""
