"""Position read-off from PushT frames: exact on drawn shapes, and within a few pixels of the simulator's state."""

import numpy as np
import pytest

from cosmos3_gym.tasks.pusht.readoff import block_centroid, read_positions


def test_centroids_of_drawn_shapes_in_table_pixels():
    frames = np.full((2, 64, 64, 3), 255, np.uint8)
    frames[0, 10:14, 20:24] = (78, 126, 255)  # agent: centre (22, 12) in frame pixels
    frames[0, 40:50, 30:34] = (143, 163, 184)  # block: centre (32, 45)
    frames[1, 40:50, 30:34] = (144, 238, 144)  # only the green target: neither part visible
    agent, block = read_positions(frames)
    np.testing.assert_allclose(agent[0], np.array([22, 12]) * 8)
    np.testing.assert_allclose(block[0], np.array([32, 45]) * 8)
    assert np.isnan(agent[1]).all() and np.isnan(block[1]).all()
    with pytest.raises(ValueError, match="frames"):
        read_positions(frames[0])


def test_block_centroid_turns_with_the_block():
    offset = block_centroid(np.array([100.0, 100.0, 0.0])) - 100.0
    turned = block_centroid(np.array([100.0, 100.0, np.pi])) - 100.0
    np.testing.assert_allclose(turned, -offset, atol=1e-9)


@pytest.mark.sim
def test_read_off_agrees_with_the_simulator_state():
    pytest.importorskip("gym_pusht")
    from cosmos3_gym.tasks.pusht import episodes as pusht

    sim = pusht.PushTSim((256, 256))
    rng = np.random.default_rng(0)
    frames, agents, poses = [], [], []
    try:
        for seed in range(12):
            frame = sim.reset(seed)
            for _ in range(4):
                frame = sim.step(rng.uniform(0, pusht.TABLE_SIZE, 2))
            frames.append(frame)
            agents.append(sim.agent_xy.copy())
            poses.append(sim.block_pose.copy())
    finally:
        sim.close()
    agent, block = read_positions(np.stack(frames))
    assert np.linalg.norm(agent - np.array(agents), axis=1).max() < 4.0
    assert np.linalg.norm(block - block_centroid(np.array(poses)), axis=1).max() < 4.0
