"""``GET /v1/models`` and ``/v1/models/{id}``: the models a live worker serves.

One body serves both SDK families, since both call ``GET /v1/models``: OpenAI's list (``object``,
``created``, ``owned_by``) and Anthropic's (``type``, ``display_name``, ``created_at`` in RFC 3339,
``has_more``/``first_id``/``last_id``, ``limit``/``after_id``/``before_id`` paging).
"""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.api.state import get_state
from shared.errors import InvalidRequest, ModelNotFound
from shared.model_card import ModelCard

__all__ = ["model_object", "router"]

router = APIRouter()

OWNER = "sluice"


def model_object(card: ModelCard) -> dict[str, object]:
    """The union model object both SDKs parse.

    Args:
        card: the model's card.

    Returns:
        ``{id, object, created, owned_by, type, display_name, created_at, max_input_tokens}``.
    """
    created = datetime.fromtimestamp(card.created, tz=UTC)
    return {
        "id": card.name,
        "object": "model",
        "created": card.created,
        "owned_by": OWNER,
        "type": "model",
        "display_name": card.name,
        "created_at": created.isoformat().replace("+00:00", "Z"),
        "max_input_tokens": card.context_length,
    }


async def _live_cards(request: Request) -> list[ModelCard]:
    state = get_state(request)
    live = await state.cards.live_models(fresh=True)
    return await state.cards.cards(sorted(live))


def _page(ids: list[str], request: Request) -> tuple[int, int]:
    params = request.query_params
    try:
        limit = int(params.get("limit", "1000"))
    except ValueError as exc:
        raise InvalidRequest("limit must be an integer", param="limit") from exc
    if not 1 <= limit <= 1000:
        raise InvalidRequest("limit must be between 1 and 1000", param="limit")
    start, end = 0, len(ids)
    if (after := params.get("after_id")) is not None:
        start = ids.index(after) + 1 if after in ids else len(ids)
    if (before := params.get("before_id")) is not None:
        end = ids.index(before) if before in ids else 0
        start = max(start, end - limit)
    return start, min(end, start + limit)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    """List the models with a live worker."""
    cards = await _live_cards(request)
    start, end = _page([c.name for c in cards], request)
    data = [model_object(c) for c in cards[start:end]]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "has_more": end < len(cards),
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> JSONResponse:
    """One model, or 404 ``model_not_found`` when no live worker serves it."""
    for card in await _live_cards(request):
        if card.name == model_id:
            return JSONResponse(model_object(card))
    raise ModelNotFound(f"The model '{model_id}' does not exist", param="model")
