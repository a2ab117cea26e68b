"""Loading and unloading LoRA adapters at run time, in vLLM's shapes (behind the API key like
every route but /health): POST /v1/load_lora_adapter {lora_name, lora_path} and
/v1/unload_lora_adapter {lora_name}. A file the model cannot serve is a 400 saying why; an
adapter that requests still use is a 409."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from engine.lora.registry import LoRAInUse
from models.lora import LoRAError
from server.errors import APIError
from server.protocol.admin import LoadLoRARequest, UnloadLoRARequest
from server.protocol.wire import parse_body
from server.state import ServerState, log


async def load_lora_adapter(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    body = await parse_body(request, LoadLoRARequest, state.config.server.max_body_bytes)
    engine = state.ready_engine()
    if not engine.lora_limits.enabled:
        raise APIError(400, "LoRA is off on this server (--max-loras 0)", param="lora_name")
    if body.lora_name == state.model_name or body.lora_name in engine.loras:
        raise APIError(
            400,
            f"The lora adapter '{body.lora_name}' has already been loaded.",
            param="lora_name",
            code="lora_exists",
        )
    try:
        ref = await engine.load_lora(body.lora_name, body.lora_path)
    except LoRAError as e:
        raise APIError(
            400,
            f"cannot load LoRA adapter {body.lora_name!r}: {e}",
            param="lora_path",
            code="invalid_lora",
        ) from None
    log.info("LoRA adapter %s loaded from %s (%s)", ref.name, body.lora_path, ref.key[:12])
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    body = await parse_body(request, UnloadLoRARequest, state.config.server.max_body_bytes)
    engine = state.ready_engine()
    try:
        await engine.unload_lora(body.lora_name)
    except KeyError:
        raise APIError(
            404,
            f"The lora adapter '{body.lora_name}' cannot be found.",
            param="lora_name",
            code="lora_not_found",
        ) from None
    except LoRAInUse as e:
        raise APIError(409, str(e), param="lora_name", code="lora_in_use") from None
    log.info("LoRA adapter %s unloaded", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
