"""Architecture adapters, declared in one registry keyed by ``config.model_type``.

Adding an architecture = one adapter file beside these and one line in :data:`REGISTRY`.
"""

from __future__ import annotations

from ..errors import ProbeError
from .base import SPACES, Adapter, SiteCapture, SpaceProblems, space_problems
from .bert import BertAdapter
from .t5 import T5Adapter

REGISTRY: dict[str, type[Adapter]] = {
    "bert": BertAdapter,
    "t5": T5Adapter,
}


def adapter_for(model_type: str) -> Adapter:
    """Return the adapter for a ``config.model_type``, or a :class:`ProbeError` listing what is supported."""
    try:
        return REGISTRY[model_type]()
    except KeyError:
        supported = ", ".join(sorted(REGISTRY))
        raise ProbeError(
            f"probe has no adapter for model type '{model_type}'. Supported model types: {supported}. "
            "To add one, write an adapter in probe/adapters/ and declare it in probe.adapters.REGISTRY."
        ) from None


__all__ = ["Adapter", "SiteCapture", "SpaceProblems", "SPACES", "space_problems", "REGISTRY", "adapter_for"]
