"""The OpenAI-compatible frontend: request/response models, serving logic, errors and routes.

Layers, top to bottom: :mod:`.router` (thin FastAPI routes) → :mod:`.serving` (completions, chat,
models) → :mod:`.choices` (choices on the engine, incremental detokenization, stop strings);
:mod:`.protocol` holds the pydantic bodies and :mod:`.errors` the one exception tree and its
mapping to the OpenAI error envelope (the agent API uses it too). Built into an app by
:mod:`megafleet_engine.server`.
"""
