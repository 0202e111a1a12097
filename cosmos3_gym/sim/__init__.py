"""Real simulators next to the world model: data generation for training and videos for comparison.

``pusht``: gym-pusht's PushT task (optional extra ``sim``; imported only when a simulator is made).
"""

from .pusht import PushTSim, ScriptedPusher, generate_pusht_dataset, side_by_side

__all__ = ["PushTSim", "ScriptedPusher", "generate_pusht_dataset", "side_by_side"]
