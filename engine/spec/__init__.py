"""Speculative decoding: where each request's drafts come from (`drafting.py`: suffix drafts from
`suffix_index.py`, grammar-forced tokens, corpus drafts from `answer_corpus.py`, the EAGLE head
of `eagle.py`), the per-request drafting
state (`draft_state.py`, a leaf), what a verify and a draft step cost on this device (`cost.py`),
and the lossless verification every source shares (`verify.py`). Imports the core's leaves, the
runner's step inputs and `models/`."""
