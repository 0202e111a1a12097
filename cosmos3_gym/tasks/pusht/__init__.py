"""PushT, the built-in example task: a world model of gym-pusht's PushT plugged into the generic layers.

It plugs in the way a user's own robot would (``registration.py``, entry points in ``pyproject.toml``): the
``cosmos3_gym/PushT-v0`` id and the built-in model ``pusht``, the ``pusht_geometric`` reward model and the scripted
policy specs (``scripted:N``, ``scripted-frames:N``, ``scripted-physics:N``).

Modules:

* the world-model env: ``env`` (``PushT-v0``, its shipped model in ``assets/``), ``projection`` (``rigid_block=True``),
  ``reward`` (coverage of a rigid T fitted to the frame), ``readoff`` (agent and block read off frames), ``demo``
  (``cosmos3-gym demo``);
* the real simulator (gym-pusht, optional extra ``sim``; imported only when a simulator is made): ``geometry`` (the T
  and the goal), ``sim`` (``PushTSim``: state save/restore), ``policies`` (scripted pusher, random waypoints, replay),
  ``frame_pusher`` (the scripted pusher acting on frames), ``episodes`` (simulated episodes, side-by-side videos; the
  simulator's public names), ``dataset`` (world-model training data), ``metrics``;
* RL and evaluation in both worlds: ``starts`` (``DemoStartStates``), ``sim_env`` / ``sim_vector_env`` (gym-pusht
  behind the world-model env's spaces, with group resets), ``demos`` (scripted demonstrations for behaviour cloning),
  ``dagger``, ``replay`` (evaluation in gym-pusht, open-loop replay of imagined episodes), ``compare`` (the world model
  against gym-pusht: frame metrics and policy rankings), ``policy_specs`` (the scripted specs).
"""
