"""Building an engine from an `EngineConfig`, once: weights, the KV pool and its tiers, the
attention backend and its warm-up (`warmup.py`), speculation and grammar (`builder.py`). The only
room that imports every other engine room; nothing in the engine imports it but the core's
`LLMEngine` constructor."""
