"""Put on a child's PYTHONPATH (tests/test_every_cpu.py): the startup bf16 probe reports what it
measures on a Zen 3 (bf16 matmul ~0.02x float32). The ISA restriction alone does not make bf16
slow on every CPU that runs the suite: on a Zen 4 under ONEDNN_MAX_CPU_ISA=AVX2 it measured
0.7-1.35x, so the refusal and the "slow here" banner would depend on the CPU and its load."""

import engine.attention.matrix as matrix

matrix.bf16_probe = lambda: 0.02
