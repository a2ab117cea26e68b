"""The one generation flow every route shares (`request_flow.py`: validate, admit, stream or
collect), and what it is made of. A generating route maps its body into a neutral conversation
(`conversation.py`; chat's in `chat_plan.py`, Anthropic's in `messages_plan.py`, the Responses
API's in `responses_plan.py`), which is planned the same way for all (`conversation_plan.py`):
rendered through the model's template (`chat_prompt.py`), its constraints made one grammar
(`constraints.py`). A choice's output is read as one stream of answer events (`answer.py`: the
thought, text, tool calls found by `tool_parsers.py`), which each route renders: chat in its
route, Anthropic's blocks (`messages_output.py`), Responses items (`responses_items.py`,
`responses_output.py`); engine outputs as API fields in `generation.py`. Imports
`server/protocol/` and the engine's door; never a route."""
