"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, as vLLM names them:
register or drop a LoRA adapter on every worker at runtime (workers started with
``--enable-lora --allow-runtime-lora-updating``; otherwise a 400 that says so)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.core.errors import invalid
from gateway.flows.fields import Fields, require_object
from gateway.flows.unsupported import refuse_unknown
from gateway.http.state import gateway_state
from gateway.http.transport import read_json
from gateway.workers.lora import load_adapter, unload_adapter

# reading an adapter's weights takes a while on a busy worker: longer than a plain unary call
UPDATE_TIMEOUT_S = 60.0


def _name(f: Fields, base_names: tuple[str, ...]) -> str:
    """The adapter's name: not one the gateway takes for the base model (its served name or
    --model), under which the adapter could never be asked for."""
    name = f.get_str("lora_name", None)
    if not name:
        raise invalid("lora_name (the adapter's name in requests) is required", "lora_name")
    if name in base_names:
        raise invalid(f"lora_name {name!r} is the base model's name", "lora_name")
    return name


async def load_lora_adapter(request: Request) -> Response:
    state = gateway_state(request)
    f = Fields(require_object(await read_json(request, state.config.max_body_bytes)))
    name = _name(f, (*state.config.model_names, state.config.model))
    path = f.get_str("lora_path", None)
    if not path:
        raise invalid("lora_path (the peft adapter directory, as the workers see it) is "
                      "required", "lora_path")  # fmt: skip
    refuse_unknown(f)
    await load_adapter(state.registry, name, path, UPDATE_TIMEOUT_S)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    state = gateway_state(request)
    f = Fields(require_object(await read_json(request, state.config.max_body_bytes)))
    name = _name(f, (*state.config.model_names, state.config.model))
    refuse_unknown(f)
    await unload_adapter(state.registry, name, UPDATE_TIMEOUT_S)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
