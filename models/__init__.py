"""Architectures, loaders, tokenizers and chat templates: what a checkpoint is, independent of
serving. A model forward takes a flat batch with positions and an attention plan; the C++ ops it
calls live in `kernels/`, the room below, which it may import. Imports nothing from `engine/` or
`server/`."""
