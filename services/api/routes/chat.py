"""Routes for this wire format (filled in by its issue)."""

from fastapi import APIRouter

router = APIRouter()
