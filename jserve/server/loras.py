"""The server's LoRA adapters, as vLLM's OpenAI server serves them: a request's `model` names an
adapter (`ServedLoras.lookup`, from `protocol.check_model`), `/v1/models` lists each with its path
as `root` and its base model as `parent`, `--lora-modules` adds them at start-up, and with
`--allow-runtime-lora-updating` (or vLLM's $VLLM_ALLOW_RUNTIME_LORA_UPDATING) an admin adds and
removes them while serving:

    POST /v1/load_lora_adapter     {"lora_name", "lora_path"}
    POST /v1/unload_lora_adapter   {"lora_name"}

Both need the admin key (`admin`). A new adapter is read on a worker thread, then added on the
engine thread between steps; the engine (`jserve.engine.lora`) refuses to remove one in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from aiohttp import web

from jserve.core.lora_slots import LoRARequest
from jserve.server import admin, fields
from jserve.server.body import read_json
from jserve.server.errors import APIError, bad_request

PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_LOAD = frozenset({"lora_name", "lora_path"})
_UNLOAD = frozenset({"lora_name", "lora_int_id"})


class NotFound(APIError):
    """vLLM's 404 shape: type "NotFoundError", code 404."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(404, message, param=param)

    def body(self) -> dict:
        body = super().body()
        body["error"].update(type="NotFoundError", code=404)
        return body


def runtime_updating(flag: bool) -> bool:
    """--allow-runtime-lora-updating, or vLLM's environment variable for it."""
    return flag or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def parse_modules(values: list[str] | None, model_names: tuple[str, ...] = ()) -> list[LoRARequest]:
    """--lora-modules values, `name=path` or vLLM's JSON `{"name", "path", "base_model_name"?}`,
    as `LoRARequest`s with ids 1, 2, ...; ValueError naming a bad one."""
    out: list[LoRARequest] = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {value}: not valid JSON ({e})") from None
            unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
            if unknown:
                raise ValueError(f"--lora-modules {value}: unknown key {unknown[0]!r} (give name, path and "
                                 f"optionally base_model_name)")
            if not all(isinstance(spec.get(k), str) and spec[k] for k in ("name", "path")) or \
                    not isinstance(spec.get("base_model_name", ""), (str, type(None))):
                raise ValueError(f"--lora-modules {value}: 'name' and 'path' must be non-empty strings and "
                                 f"'base_model_name' a string")
            name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value}: expected name=path or a JSON object")
            base = None
        if name in model_names or any(r.lora_name == name for r in out):
            raise ValueError(f"--lora-modules {value}: the name {name!r} is taken (a served model name or "
                             f"another adapter)")
        out.append(LoRARequest(name, len(out) + 1, path, base))
    return out


def add_modules(engine: Any, modules: list[LoRARequest]) -> None:
    """Add the start-up adapters to an `LLMEngine` not yet serving; ValueError naming a bad one."""
    if modules and engine.lora is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for module in modules:
        try:
            engine.lora.add(module)
        except (ValueError, OSError) as e:
            raise ValueError(f"--lora-modules {module.lora_name}={module.lora_path}: {e}") from None


class ServedLoras:
    """The adapters requests may name, mirrored from the engine's `LoraManager` (read on the event
    loop; changed only by the routes below, after the engine has)."""

    def __init__(self, allow_updating: bool = False):
        self.allow_updating = allow_updating
        self.enabled = False  # whether the engine serves LoRA adapters (known at attach)
        self.adapters: dict[str, LoRARequest] = {}
        self.last_id = 0  # the adapters' lora_int_id, as vLLM counts them: 1, 2, ... never reused

    def attach(self, engine: Any) -> None:
        """`engine`: the AsyncLLMEngine; its `LoraManager`, if any, holds the start-up adapters."""
        self.enabled = engine.lora_enabled
        engine.only_added_loras()  # adapters come and go through --lora-modules and the routes only
        self.adapters = {r.lora_name: r for r in engine.lora_adapters()}
        self.last_id = max((r.lora_int_id for r in self.adapters.values()), default=0)

    def lookup(self, model: str) -> LoRARequest:
        """The adapter named `model`; vLLM's 404 if there is none."""
        found = self.adapters.get(model)
        if found is None:
            raise NotFound(f"The model `{model}` does not exist.", param="model")
        return found

    def cards(self, base_model: str, created: int, max_model_len: int) -> list[dict]:
        """/v1/models entries, as vLLM lists adapters."""
        return [{"id": r.lora_name, "object": "model", "created": created, "owned_by": "jserve",
                 "root": r.lora_path, "parent": r.base_model_name or base_model, "max_model_len": max_model_len}
                for r in self.adapters.values()]


def register(app: web.Application, loras: ServedLoras, key: str | None) -> None:
    """The load / unload routes, with runtime updating allowed (which needs the admin key)."""
    if not loras.allow_updating:
        return
    if not key:
        raise ValueError("runtime LoRA updating (--allow-runtime-lora-updating) needs an admin key (--admin-key "
                         "or $JSERVE_ADMIN_KEY): only an admin loads and unloads adapters")
    app.router.add_post(PATHS[0], load_adapter)
    app.router.add_post(PATHS[1], unload_adapter)


async def _body(request: web.Request, allowed: frozenset[str]) -> tuple[Any, Any, dict]:
    """The engine, the server state and the body, once the admin key is checked."""
    engine = admin.admin_engine(request)
    state = request.app[admin.SERVER]
    body = await read_json(request, state.timeouts.body)
    fields.check_fields(body, allowed)
    if not state.loras.enabled:
        raise bad_request("this server serves no LoRA adapters: start it with --enable-lora")
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"'lora_name' must be a non-empty string, got {name!r}", param="lora_name")
    return engine, state, body


async def load_adapter(request: web.Request) -> web.Response:
    engine, state, body = await _body(request, _LOAD | {"load_inplace"})
    if body.get("load_inplace") not in (None, False):
        raise bad_request("load_inplace is not supported: unload the adapter first", param="load_inplace")
    name, path = body["lora_name"], body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise bad_request(f"'lora_path' must be a non-empty string, got {path!r}", param="lora_path")
    if name in state.model_names:
        raise bad_request(f"'{name}' is the served model's name: give the adapter another", param="lora_name")
    if name in state.loras.adapters:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    state.loras.last_id += 1
    lora = LoRARequest(name, state.loras.last_id, path)
    try:  # off the event loop and the engine thread: a Hub id downloads, a folder is read and checked
        weights = await asyncio.to_thread(engine.read_lora, lora)
    except (ValueError, OSError) as e:
        raise bad_request(f"cannot load LoRA adapter {name!r} from {path!r}: {e}", param="lora_path") from None
    await asyncio.shield(_change(state.loras, lora, engine.add_lora(lora, weights)))
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_adapter(request: web.Request) -> web.Response:
    engine, state, body = await _body(request, _UNLOAD)
    name = body["lora_name"]
    lora = state.loras.adapters.get(name)
    if lora is None or body.get("lora_int_id") not in (None, lora.lora_int_id):
        raise NotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name")
    await asyncio.shield(_change(state.loras, lora, engine.remove_lora(name), add=False))
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _change(loras: ServedLoras, lora: LoRARequest, call: Any, add: bool = True) -> None:
    """`call` (the engine's change, between its steps), and the served names to match (shielded: a client that goes
    away does not leave the two apart). An unloaded name is gone first, so that no new request
    names it while the engine removes it; a 400 puts it back."""
    if not add:
        del loras.adapters[lora.lora_name]
    try:
        await admin.as_400(call)
    except APIError:
        if not add:
            loras.adapters[lora.lora_name] = lora
        raise
    if add:
        loras.adapters[lora.lora_name] = lora
