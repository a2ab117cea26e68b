"""The request core: a request's state (`request.py`) and sampling parameters, the scheduler
that grants tokens under the step budget, the synchronous engine whose `step` reads schedule ->
run -> update -> emit (`llm_engine.py`), and what leaves a step (`output_processor.py`:
detokenized deltas and stop strings; `outputs.py`; `snapshot.py` and `engine_info.py`, the plain
data the server reads). May import the other engine rooms and `models/`; `request.py`,
`sampling_params.py` and `outputs.py` are leaves every room may import."""
