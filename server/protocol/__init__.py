"""What crosses the wire: the request and response bodies of each API as pydantic models
(`openai.py` for chat and completions, `responses.py`, `anthropic.py`, `embeddings.py`,
`structured.py` for tools and structured outputs, `admin.py` for the routes around
generation), the documented schema limits, and the one decode/serialise step at the edge
(`wire.py`). Imports only the engine's sampling parameters; routes and the flow import it."""
