"""Helper agents built on the engine's other two modes: ``PolicyAgent`` (image + task -> action chunk) and
``InverseDynamicsAgent`` (video -> action chunk)."""

from .inverse_dynamics import InverseDynamicsAgent, action_errors, video_windows
from .policy import PolicyAgent

__all__ = ["InverseDynamicsAgent", "PolicyAgent", "action_errors", "video_windows"]
