"""The one generation flow every route shares (`request_flow.py`: validate, admit, stream or
collect), and what it is made of: chat messages to the template's prompt (`chat_prompt.py`), the
grammar a request's constraints make (`constraints.py`), tool calls read back from text
(`tool_parsers.py`), engine outputs as API fields (`generation.py`) and as Responses items
(`responses_items.py`). Imports `server/protocol/` and the engine's door; never a route."""
