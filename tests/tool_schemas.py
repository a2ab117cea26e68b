"""The tools the tool-calling tests offer the model, the question that wants one, and the
greedy chat request that asks it."""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]


def ask_for_a_tool(client, model: str, tools: list[dict], tool_choice, max_tokens: int, **extra):
    """ASK through an `openai` client's chat completions with `tools` offered under
    `tool_choice`, greedy unless `extra` sets a temperature; `extra`: more request fields.
    Returns the completion (or its stream)."""
    return client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=max_tokens,
        **{"temperature": 0, **extra},
    )
