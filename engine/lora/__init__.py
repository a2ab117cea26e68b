"""LoRA adapters the engine serves (`registry.py`): which are loaded, by name, read from their files
by `models/lora.py` and checked against the model; the scheduler admits requests of at most
`max_loras` adapters at a time, the runner gives each step's rows to their adapters
(`models.lora.LoRARows`), and an adapter's fingerprint keys its KV blocks
(`SamplingParams.cache_namespace`). Imports the core's leaves and `models/`."""
