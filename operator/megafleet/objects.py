"""The one alias for a Kubernetes object as JSON, shared by the operator, the SDK and the dev tools.

A body read from or written to the API server is a plain ``dict``: the operator parses the parts it
acts on into typed views (``fleet_state.pods.Pod``, the API models) and passes the rest through untouched.
"""

from typing import Any

__all__ = ["Object"]

Object = dict[str, Any]
"""A Kubernetes object (or any JSON object inside one) as the API server sends it."""
