"""LoRA adapters served beside the base model: PEFT checkpoints read and checked against the
model (adapter.py), the per-linear LoRA term over GPU slots (layer.py) and the manager that
keeps the registry, the host cache and the slots (manager.py). The flags' entries are parsed by
config/lora_modules.py."""
