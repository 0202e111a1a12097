"""Real simulators next to the world model: data generation for training and videos for comparison.

``pusht``: gym-pusht's PushT task (optional extra ``sim``; imported only when a simulator is made), split into
``pusht_geometry`` (the T and the goal), ``pusht_policies`` (scripted pusher, random waypoints, replay),
``pusht_sim`` (``PushTSim``: state save/restore), ``pusht_dataset`` (world-model training data) and ``pusht_metrics``
and re-exported from ``pusht``. For RL: ``starts`` (``DemoStartStates``: frames and simulator states from any
demonstration step), ``pusht_vector_env`` (``PushTSimVectorEnv``: gym-pusht behind the world model's vector-env
interface, with group resets), ``pusht_demos`` (scripted demonstrations for behaviour cloning) and ``pusht_replay``
(evaluation in gym-pusht, open-loop replay of imagined episodes).
"""

from .pusht import PushTSim, ScriptedPusher, generate_pusht_dataset, side_by_side

__all__ = ["PushTSim", "ScriptedPusher", "generate_pusht_dataset", "side_by_side"]
