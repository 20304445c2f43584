"""The wire formats: pure translation between HTTP bodies, jobs, events and SSE frames.

One package per format (``openai_chat``, ``openai_responses``, ``anthropic_messages``), each
with the same modules and entry points: ``request.parse_request`` (body -> job), ``types``
(response Structs and the projection ``Context``), ``projector.Projector`` (events -> frames)
and ``render.render`` (the non-streaming body from ``fold(events)``). ``sse`` frames SSE,
``common`` holds the parsing rules and the ``Error`` -> exception mapping all formats share,
``openai_errors`` the error envelope both OpenAI formats use. Nothing here imports the rest of
``services.api`` (an import-linter contract), does I/O, reads the clock or draws random ids.
"""
