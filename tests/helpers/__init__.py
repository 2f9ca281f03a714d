"""What several test modules share: engine processes and in-process servers, refit harnesses, GPU
settings, the refit end-to-end helpers, and an in-memory stand-in for the operator's API layer.

Imported as ``from helpers import ...``: ``tests/`` is on ``sys.path`` because the root conftest lives
there. Nothing here is collected as a test.
"""
