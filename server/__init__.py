"""The HTTP side: a Starlette app (`app.py`) over the engine's one door (`engine.async_engine`),
with its routes (`routes/`), wire models (`protocol/`), the one generation flow (`flow/`), and the
state around them (config, sessions, stored responses, per-application cache statistics, metrics).
Imports `engine/` and `models/`; nothing below imports it."""
