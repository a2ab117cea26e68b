"""/openapi.json, generated from the pydantic protocol models (requests and responses alike)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from server.protocol import admin as pad
from server.protocol import anthropic as pa
from server.protocol import embeddings as pe
from server.protocol import openai as p
from server.protocol import responses as pr

REF = "#/components/schemas/{model}"


def _schema(models: list[type[BaseModel]]) -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in models:
        s = model.model_json_schema(ref_template=REF, mode="serialization")
        schemas.update(s.pop("$defs", {}))
        schemas[model.__name__] = s
    # request models are read in validation mode (defaults optional)
    return schemas


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": _ref(model)}}}


def _errors(*codes: int, shape: type[BaseModel] = pad.ErrorResponse) -> dict[str, Any]:
    return {str(c): {"description": "error", **_json(shape)} for c in codes}


def build_openapi(version: str) -> dict[str, Any]:
    requests = [
        p.ChatCompletionRequest,
        p.CompletionRequest,
        pe.EmbeddingRequest,
        pr.ResponsesRequest,
        pa.MessagesRequest,
        pa.CountTokensRequest,
        pad.TokenizeRequest,
        pad.DetokenizeRequest,
    ]
    responses = [
        p.ChatCompletionResponse,
        p.ChatCompletionChunk,
        p.CompletionResponse,
        pe.EmbeddingResponse,
        pr.ResponseObject,
        pr.ResponseEvent,
        pr.ResponseDeleted,
        pr.ItemList,
        pad.ModelList,
        pad.ModelCard,
        pad.TokenizeResponse,
        pad.DetokenizeResponse,
        pad.ErrorResponse,
        pad.StatusResponse,
        pa.AnthropicMessage,
        pa.AnthropicStreamEvent,
        pa.AnthropicTokenCount,
        pa.AnthropicError,
    ]
    schemas: dict[str, Any] = {}
    for model in requests:
        s = model.model_json_schema(ref_template=REF, mode="validation")
        schemas.update(s.pop("$defs", {}))
        schemas[model.__name__] = s
    schemas.update(_schema(responses))
    api_errors = _errors(400, 401, 404, 413, 429, 500, 503)
    anthropic_errors = _errors(400, 401, 404, 413, 429, 500, 503, shape=pa.AnthropicError)
    # each server-sent event: `data` is a JSON chunk (or the literal [DONE])
    sse = {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "required": ["data"],
                "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
            }
        }
    }

    def post(
        req: type[BaseModel],
        resp: type[BaseModel],
        summary: str,
        streams: bool = False,
        errors: dict[str, Any] = api_errors,
    ) -> dict[str, Any]:
        ok = {"description": "ok", **_json(resp)}
        if streams:
            ok = {
                "description": "completion, or an SSE stream when stream=true",
                "content": {"application/json": {"schema": _ref(resp)}, **sse},
            }
        return {
            "post": {
                "summary": summary,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref(req)}},
                },
                "responses": {"200": ok, **errors},
            }
        }

    def get(resp: type[BaseModel], summary: str) -> dict[str, Any]:
        return {
            "get": {
                "summary": summary,
                "responses": {"200": {"description": "ok", **_json(resp)}, **api_errors},
            }
        }

    response_id = {
        "name": "response_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvserve",
            "version": version,
            "description": "OpenAI-compatible inference server (and Anthropic's Messages API)",
        },
        "paths": {
            "/v1/chat/completions": post(
                p.ChatCompletionRequest,
                p.ChatCompletionResponse,
                "Create a chat completion",
                streams=True,
            ),
            "/v1/completions": post(
                p.CompletionRequest, p.CompletionResponse, "Create a completion", streams=True
            ),
            "/v1/embeddings": post(pe.EmbeddingRequest, pe.EmbeddingResponse, "Create embeddings"),
            "/v1/responses": post(
                pr.ResponsesRequest, pr.ResponseObject, "Create a response", streams=True
            ),
            "/v1/responses/{response_id}": {
                "parameters": [response_id],
                **get(pr.ResponseObject, "A stored response"),
                "delete": {
                    "summary": "Delete a stored response",
                    "responses": {
                        "200": {"description": "ok", **_json(pr.ResponseDeleted)},
                        **api_errors,
                    },
                },
            },
            "/v1/responses/{response_id}/input_items": {
                "parameters": [response_id],
                **get(pr.ItemList, "The items a stored response was generated from"),
            },
            "/v1/messages": post(
                pa.MessagesRequest,
                pa.AnthropicMessage,
                "Create a message (Anthropic's Messages API)",
                streams=True,
                errors=anthropic_errors,
            ),
            "/v1/messages/count_tokens": post(
                pa.CountTokensRequest,
                pa.AnthropicTokenCount,
                "Count a message's input tokens",
                errors=anthropic_errors,
            ),
            "/v1/models": get(pad.ModelList, "List models"),
            "/tokenize": post(
                pad.TokenizeRequest, pad.TokenizeResponse, "Tokenize text or messages"
            ),
            "/detokenize": post(pad.DetokenizeRequest, pad.DetokenizeResponse, "Token ids to text"),
            "/health": {
                "get": {
                    "summary": "Liveness and readiness",
                    "responses": {
                        "200": {"description": "ready", **_json(pad.StatusResponse)},
                        "503": {
                            "description": "loading, draining or failed",
                            **_json(pad.StatusResponse),
                        },
                    },
                }
            },
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
