"""LoRA adapters served beside the base model (issue 48): the flags' parsing (modules.py), PEFT
checkpoints read and checked against the model (adapter.py), the per-linear LoRA term over GPU
slots (layer.py) and the manager that keeps the registry, the host cache and the slots (manager.py)."""
