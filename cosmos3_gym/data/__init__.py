"""Data: episode datasets (this package's layout and LeRobot v3.0 / v2.1), and the start states envs reset to.

``episodes``: the episode dataset layout the trainers read (``read_episode_dataset``, ``load_episode``).
``lerobot``: LeRobot datasets, read (``LeRobotDataset``, ``"lerobot:PATH"`` specs) and written
(``write_lerobot_dataset``). ``initial_states``: ``load_initial_states`` turns images, videos, arrays, folders,
``lerobot:PATH`` and a checkpoint's start-frame archive into an ``InitialStateSource``.
"""

from .episodes import DatasetInfo, Episode, load_episode, read_episode_dataset
from .initial_states import InitialState, InitialStateSource, load_initial_states, resize_frame
from .lerobot import LeRobotDataset, read_lerobot_dataset, write_lerobot_dataset

__all__ = [
    "DatasetInfo",
    "Episode",
    "InitialState",
    "InitialStateSource",
    "LeRobotDataset",
    "load_episode",
    "load_initial_states",
    "read_episode_dataset",
    "read_lerobot_dataset",
    "resize_frame",
    "write_lerobot_dataset",
]
