"""Executors: how an engine runs when it is not one object in this process (vLLM's executor / worker split).

``client``: ``EngineClient`` starts tp x cfg worker processes (``python -m cosmos3_gym.executors.worker``; they never
import the user's script) and speaks to them over pipes (``messages``); ``ray_replicas``: data-parallel engine
replicas as Ray actors; ``remote``: what both share. ``cosmos3_gym.load_engine`` picks one; every executor implements
the whole ``WorldModelEngine`` protocol. The parallelism inside an engine (mesh, tensor parallel, tile decode) is
``cosmos3_gym.parallel``.
"""
