"""Quantized weights: the FP8 linear method (fp8_linear.py) and its activations (fp8_activations.py).
Which FP8 format a checkpoint is in is read with the model's config (worker/config/quantization.py)."""
