"""OpenAI's Responses API (/v1/responses) over the chat path: ``protocol.py`` (the body),
``convert.py`` (input items -> chat messages), ``format.py`` (response objects and output
items), ``events.py`` (the streamed events), ``store.py`` (stored responses per tenant),
``routes.py`` (the endpoints)."""
from __future__ import annotations

from triptych.api.responses.routes import add_responses_routes

__all__ = ["add_responses_routes"]
