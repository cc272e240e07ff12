"""`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's routes): hot-swap LoRA
adapters while requests run; loads are confined to `--lora-root` unless the operator allowed any
path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter

from serve.http.protocol import LoadLoraRequest, UnloadLoraRequest
from serve.http.serving import RequestError
from serve.http.state import Server

router = APIRouter()


def adapter_path(raw: str, root: Path | None) -> Path:
    """The adapter dir (relative paths from the server's working dir), refused when it is
    outside `root` once `..` and symlinks are resolved."""
    try:
        path = Path(raw).expanduser()
        resolved = path.resolve()
    except (OSError, RuntimeError, ValueError) as e:
        raise RequestError(400, f"lora_path is not a usable path ({e})", "lora_path") from None
    if root is None:
        return path
    if not resolved.is_relative_to(root.resolve()):
        raise RequestError(
            400,
            f"lora_path {raw!r} is outside the adapter root {str(root)!r}; "
            "adapters load only from inside it",
            "lora_path",
        )
    return resolved


@router.post("/v1/load_lora_adapter")
async def load_lora(body: LoadLoraRequest, server: Server) -> dict[str, Any]:
    settings = server.settings
    if body.lora_name == settings.model_name:
        raise RequestError(
            400,
            f"lora_name {body.lora_name!r} is the base model's name; pick another",
            "lora_name",
        )
    if settings.lora_root is None and not settings.allow_any_lora_path:
        raise RequestError(
            403,
            "loading adapters over HTTP is off: restart the server with --lora-root DIR "
            "(adapters load only from inside DIR) or --allow-any-lora-path",
            "lora_path",
            "lora_loading_disabled",
        )
    path = adapter_path(body.lora_path, settings.lora_root)
    version, evicted = await server.engine.load_lora(
        body.lora_name, path, settings.lora_root, body.evict
    )
    return {"status": "loaded", "lora_name": body.lora_name, "version": version, "evicted": evicted}


@router.post("/v1/unload_lora_adapter")
async def unload_lora(body: UnloadLoraRequest, server: Server) -> dict[str, Any]:
    version = await server.engine.unload_lora(body.lora_name)
    return {"status": "unloaded", "lora_name": body.lora_name, "version": version}
