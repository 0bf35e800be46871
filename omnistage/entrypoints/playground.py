"""The browser playground: ``GET /`` serves one page (files in ``entrypoints/static``: no build step, nothing
from a CDN, works offline) that talks to the same streaming ``POST /v1/chat/completions`` as every client.

``GET /playground/info`` describes the served model for the page (JSON):

- ``model``: the name to pass as ``model``; ``family``: the model family;
- ``built_in``: true for the built-in test model (random weights; the page says so);
- ``output_modalities`` (e.g. ``["text", "audio"]``) and ``input_modalities`` (``["text"]``, plus ``"audio"``,
  ``"image"``, ``"video"`` for a model with towers; the page shows its microphone / audio-file controls when this
  lists ``"audio"`` and its image control for ``"image"``, and sends what they hold with the next message as
  ``input_audio`` / ``image_url`` parts);
- ``voices``, ``default_voice``, ``sample_rate`` (of the streamed pcm16; empty / null without speech);
- ``max_model_len``: the prompt stage's context limit;
- ``sampling``: the text stage's defaults (``temperature``, ``top_p``, ``max_tokens``).

``input_modalities`` is read from ``app.state.input_modalities``, which ``create_app`` sets from the model's
towers (``ModelInfo.input_modalities``).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from omnistage.checkpoints.default_model import DEFAULT_PRESET, DEFAULT_SEED, builder_fingerprint

_STATIC = resources.files("omnistage.entrypoints") / "static"
_ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
# Served files change with the installed package, not per request; revalidating keeps upgrades visible.
_HEADERS = {"Cache-Control": "no-cache"}

router = APIRouter()


def _asset(name: str) -> bytes:
    return (_STATIC / name).read_bytes()


@router.get("/", include_in_schema=False)
async def page() -> Response:
    return Response(_asset("index.html"), media_type="text/html; charset=utf-8", headers=_HEADERS)


@router.get("/playground/static/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    if name not in _ASSETS:
        raise HTTPException(404, f"no playground file {name!r}")
    return Response(_asset(name), media_type=_ASSETS[name], headers=_HEADERS)


def is_built_in(checkpoint_name: str) -> bool:
    """Whether the served checkpoint is the built-in model (its cache directory name, see checkpoints.default_model)."""
    return checkpoint_name == f"{DEFAULT_PRESET}-seed{DEFAULT_SEED}-{builder_fingerprint()}"


@router.get("/playground/info")
async def info(request: Request) -> JSONResponse:
    state = request.app.state
    model = state.omni.info
    text = model.stage_sampling[model.text_stage]
    body: dict[str, Any] = {
        "model": state.served_model_name,
        "family": model.family,
        "built_in": is_built_in(model.name),
        "output_modalities": list(model.output_modalities),
        "input_modalities": list(getattr(state, "input_modalities", ("text",))),
        "voices": list(model.voices) if "audio" in model.output_modalities else [],
        "default_voice": model.default_voice if "audio" in model.output_modalities else None,
        "sample_rate": model.sample_rate if "audio" in model.output_modalities else None,
        "max_model_len": model.max_model_len,
        "sampling": {"temperature": text.temperature, "top_p": text.top_p, "max_tokens": text.max_tokens},
    }
    return JSONResponse(body, headers=_HEADERS)
