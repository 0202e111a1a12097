"""Tasks: environment families built on the generic layers, each in its own package (the bundled example:
``tasks/pusht``).

A task reaches the generic code only through its registries and entry points (``pyproject.toml``): the
``cosmos3_gym.tasks`` group registers env ids and built-in models (``cosmos3_gym.registration``), the
``cosmos3_gym.reward_models`` group adds reward models (``cosmos3_gym.rewards.registry``), and
``policy_specs.register_policy_kind`` adds policy specs. A user's own robot plugs in the same way, from its own
package.
"""
