"""Constrained decoding: grammars compiled with xgrammar and one matcher per request
(`structured_output.py`), compiles within a time budget (`budget.py`), objects with many
properties compiled in near-linear time (`object_properties.py`), and the bitmask applied to
logits rows (`token_bitmask.py`, with its C++ op from `kernels/`). Imports the core's leaves,
`models/` and `kernels/`."""
