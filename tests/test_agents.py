"""Agent frameworks nobody here wrote run their loops to the end against the default model at
float32, with a token budget a user would set (128): the OpenAI Agents SDK (a function tool, and
an output type, through chat completions and through the Responses API) and pydantic-ai (a tool
and an output type). The forced tool is called; the final output validates."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel, Field

from tests.conftest import SMOL

pytestmark = pytest.mark.slow  # a kvserve process on the 135M model

BUDGET = 128


class Weather(BaseModel):
    city: str = Field(max_length=24)
    summary: str = Field(max_length=60)


@pytest.fixture(scope="module")
def server(smol_tools_server):
    return smol_tools_server  # shared with test_tools_structured.py (one SmolLM2 start)


def weather_tool(calls: list[str]):
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"{city}: 21 C and sunny"

    return get_weather


def agents_model(server, api: str):
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
    model_cls = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    return model_cls(model=SMOL, openai_client=client)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_sdk_runs_a_forced_tool_to_the_end(server, api) -> None:
    from agents import Agent, ModelSettings, Runner, function_tool

    calls: list[str] = []
    agent = Agent(
        name="weather",
        instructions="Answer with the weather. Use the tool.",
        model=agents_model(server, api),
        tools=[function_tool(weather_tool(calls))],
        model_settings=ModelSettings(tool_choice="required", max_tokens=BUDGET, temperature=0),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert calls, "the forced tool was never run"
    assert isinstance(result.final_output, str) and result.final_output


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_sdk_returns_its_output_type(server, api) -> None:
    from agents import Agent, ModelSettings, Runner

    agent = Agent(
        name="weather",
        instructions="Report the weather in Paris: 21 C and sunny.",
        model=agents_model(server, api),
        model_settings=ModelSettings(max_tokens=BUDGET, temperature=0),
        output_type=Weather,
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=2))
    assert isinstance(result.final_output, Weather)


def test_pydantic_ai_runs_a_tool_and_returns_its_output_type(server) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.messages import RetryPromptPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.usage import UsageLimits

    provider = OpenAIProvider(base_url=server.base + "/v1", api_key="x")
    calls: list[str] = []
    agent = Agent(
        OpenAIChatModel(SMOL, provider=provider),
        output_type=Weather,
        tools=[weather_tool(calls)],
        instructions="Look the weather up with get_weather, then report it.",
        model_settings=ModelSettings(max_tokens=BUDGET, temperature=0),
        retries=2,
    )
    result = agent.run_sync("Weather in Paris?", usage_limits=UsageLimits(request_limit=6))
    assert isinstance(result.output, Weather)
    # validation retries are counted, not hidden: a retry is a RetryPromptPart the framework
    # sent back after a call or an output failed its schema; the server's grammar leaves none
    retries = [
        part
        for message in result.all_messages()
        for part in getattr(message, "parts", [])
        if isinstance(part, RetryPromptPart)
    ]
    print(f"pydantic-ai: {len(retries)} validation retries, {result.usage().requests} requests")
    assert not retries, retries
