"""One step on the device: the flat inputs of a scheduled batch (`step_inputs.py`), the forward and
the logits rows to sample (`model_runner.py`, CUDA graphs in `cuda_graphs.py`), the batched sampler,
embedding pooling, and the one object a step returns (`runner_output.py`: sampled or verified
tokens, pooled vectors, failed rows). Imports the core's leaves, `attention/`, `kv/` and
`models/`; never the scheduler's policy or the server."""
