"""Weights as they serve: GGUF blocks kept as stored, and weights quantized at load and judged on
held-out text before they serve, refused with the measurement where they fall short
(`quantization.py`); a GGUF's many-row steps on smoothed int8 W8A8 copies, calibrated, timed and
judged by projection (`int8_dense.py`). Imports `models/` and the runner's step inputs."""
