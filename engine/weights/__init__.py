"""Weights as they serve: GGUF blocks kept as stored, and weights quantized at load and judged on
held-out text before they serve, refused with the measurement where they fall short
(`quantization.py`). Imports `models/` and the runner's step inputs."""
