"""What the worker is configured with: the engine's flags (engine.py: EngineConfig), the model's
shape read from its config.json (model.py: ModelConfig), its FP8 format (quantization.py), and
the error for a checkpoint pdserve cannot run (unsupported_model.py). Imports no other room."""
