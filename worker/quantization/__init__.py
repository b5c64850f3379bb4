"""Quantized weights: FP8 checkpoint formats (config.py) and the FP8 linear method (fp8_linear.py)."""
