"""cosmos3_gym.sampling against diffusers' UniPCMultistepScheduler (the numerics reference) and written formulas."""

import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler

from cosmos3_gym.errors import InputError
from cosmos3_gym.sampling import FlowUniPCSampler, cfg_combine, make_schedule

FLOW_CONFIG = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 5.0}
KARRAS_RANGES = [(0.01, 200.0), (0.147, 200.0)]  # Cosmos-Predict2.5 diffusers config; Cosmos3 (PhyAI)
MAX_RELATIVE_ERROR = 1e-5


def karras_config(sigma_min, sigma_max, **extra):
    return {**FLOW_CONFIG, "use_karras_sigmas": True, "sigma_min": sigma_min, "sigma_max": sigma_max, **extra}


def diffusers_scheduler(config, num_steps):
    scheduler = UniPCMultistepScheduler.from_config(config)
    scheduler.set_timesteps(num_steps)
    return scheduler


def linear_flow_formula(num_steps, shift, num_train_timesteps=1000):
    """performance.md §6.1 steps 1-5, written out independently of diffusers."""
    sigmas = np.linspace(1, 1 / num_train_timesteps, num_steps + 1)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    if abs(sigmas[0] - 1) < 1e-6:
        sigmas[0] -= 1e-6
    timesteps = (sigmas * num_train_timesteps).astype(np.int64)
    return np.append(sigmas, 0.0).astype(np.float32), timesteps


def karras_flow_formula(num_steps, sigma_min, sigma_max, rho=7.0):
    """EDM Karras sigmas over num_steps points mapped to flow by s / (1 + s); no shift, no 1e-6 adjustment."""
    ramp = np.linspace(0, 1, num_steps)
    edm = (sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    sigmas = edm / (edm + 1)
    return np.append(sigmas, 0.0).astype(np.float32), (sigmas * 1000).astype(np.int64)


# ---------------------------------------------------------------- grids


@pytest.mark.parametrize("num_steps", [1, 2, 4, 10, 30, 35])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 10.0, 12.0])
def test_linear_flow_grid_equals_diffusers_and_formula(num_steps, shift):
    config = {**FLOW_CONFIG, "flow_shift": shift}
    schedule = make_schedule(num_steps, config)
    reference = diffusers_scheduler(config, num_steps)
    np.testing.assert_array_equal(schedule.sigmas, reference.sigmas.numpy())
    np.testing.assert_array_equal(schedule.timesteps, reference.timesteps.numpy())
    assert schedule.timesteps.dtype == np.int64 and schedule.sigmas[-1] == 0
    formula_sigmas, formula_timesteps = linear_flow_formula(num_steps, shift)
    np.testing.assert_array_equal(schedule.sigmas, formula_sigmas)
    np.testing.assert_array_equal(schedule.timesteps, formula_timesteps)


@pytest.mark.parametrize("num_steps", [1, 2, 4, 10, 30, 35, 36])
@pytest.mark.parametrize("sigma_range", KARRAS_RANGES)
def test_karras_flow_grid_equals_diffusers_and_formula(num_steps, sigma_range):
    config = karras_config(*sigma_range)
    schedule = make_schedule(num_steps, config)
    reference = diffusers_scheduler(config, num_steps)
    np.testing.assert_array_equal(schedule.sigmas, reference.sigmas.numpy())
    np.testing.assert_array_equal(schedule.timesteps, reference.timesteps.numpy())
    formula_sigmas, formula_timesteps = karras_flow_formula(num_steps, *sigma_range)
    np.testing.assert_array_equal(schedule.sigmas, formula_sigmas)
    np.testing.assert_array_equal(schedule.timesteps, formula_timesteps)
    # diffusers ignores flow_shift with Karras sigmas.
    np.testing.assert_array_equal(make_schedule(num_steps, config, flow_shift=12.0).sigmas, schedule.sigmas)


def test_overrides_select_the_grid():
    karras = karras_config(0.147, 200.0, flow_shift=10.0)
    forced_linear = make_schedule(10, karras, use_karras_sigmas=False, flow_shift=3.0)
    np.testing.assert_array_equal(forced_linear.sigmas, linear_flow_formula(10, 3.0)[0])
    assert not forced_linear.use_karras_sigmas and forced_linear.flow_shift == 3.0
    config_shift = make_schedule(10, karras, use_karras_sigmas=False)
    np.testing.assert_array_equal(config_shift.sigmas, linear_flow_formula(10, 10.0)[0])
    forced_karras = make_schedule(10, {**FLOW_CONFIG, "sigma_min": 0.147, "sigma_max": 200.0}, use_karras_sigmas=True)
    np.testing.assert_array_equal(forced_karras.sigmas, karras_flow_formula(10, 0.147, 200.0)[0])
    assert forced_karras.use_karras_sigmas


# performance.md §6.1 reference values (6 decimals): config, sigma[0:3], sigma[-3:], timesteps[0:3], timesteps[-1].
REFERENCE_TABLE = [
    ({**FLOW_CONFIG, "flow_shift": 5.0}, 50, [0.999999, 0.995939, 0.991744], [0.175969, 0.096778, 0], [999, 995, 991],
     96),
    ({**FLOW_CONFIG, "flow_shift": 12.0}, 40, [0.999999, 0.997870, 0.995638], [0.391810, 0.242431, 0], [999, 997, 995],
     242),
    ({**FLOW_CONFIG, "flow_shift": 3.0}, 50, [0.999999, 0.993250, 0.986315], [0.113576, 0.060405, 0], [999, 993, 986],
     60),
    (karras_config(0.01, 200.0), 36, [0.995025, 0.994207, 0.993232], [0.017841, 0.009901, 0], [995, 994, 993], 9),
]


@pytest.mark.parametrize("config, num_steps, head, tail, head_timesteps, last_timestep", REFERENCE_TABLE)
def test_performance_md_reference_values(config, num_steps, head, tail, head_timesteps, last_timestep):
    schedule = make_schedule(num_steps, config)
    np.testing.assert_allclose(schedule.sigmas[:3], head, atol=6e-7, rtol=0)
    np.testing.assert_allclose(schedule.sigmas[-3:], tail, atol=6e-7, rtol=0)
    assert schedule.timesteps[:3].tolist() == head_timesteps and schedule.timesteps[-1] == last_timestep


def test_native_flow_schedule_matches_cosmos3_pipeline_and_reference():
    # Cosmos3OmniPipeline(use_native_flow_schedule=True) passes sigmas = linspace(1 - 1/T, 0, N + 1)[:-1].
    schedule = make_schedule(4, FLOW_CONFIG, use_native_flow_schedule=True)
    reference = UniPCMultistepScheduler.from_config(FLOW_CONFIG)
    reference.set_timesteps(4, sigmas=np.linspace(1.0 - 1.0 / 1000, 0.0, 5)[:-1])
    np.testing.assert_array_equal(schedule.sigmas, reference.sigmas.numpy())
    np.testing.assert_array_equal(schedule.timesteps, reference.timesteps.numpy())
    # cosmos3.md §4 example: n=4, shift 5.
    np.testing.assert_allclose(schedule.sigmas, [0.9998, 0.9373, 0.8331, 0.6247, 0], atol=5e-5)
    assert schedule.timesteps.tolist() == [999, 937, 833, 624]
    # With sigma_min/sigma_max in the config, diffusers' Karras grid does not depend on the passed sigmas.
    karras = karras_config(0.147, 200.0)
    native_karras = make_schedule(4, karras, use_native_flow_schedule=True)
    np.testing.assert_array_equal(native_karras.sigmas, make_schedule(4, karras).sigmas)


def test_accepts_a_diffusers_frozen_config():
    frozen = UniPCMultistepScheduler(**FLOW_CONFIG).config
    np.testing.assert_array_equal(make_schedule(10, frozen).sigmas, make_schedule(10, FLOW_CONFIG).sigmas)


@pytest.mark.parametrize(
    "key, value",
    [
        ("prediction_type", "epsilon"),
        ("use_flow_sigmas", False),
        ("solver_type", "bh1"),
        ("solver_order", 4),
        ("final_sigmas_type", "sigma_min"),
        ("use_dynamic_shifting", True),
        ("lower_order_final", False),
        ("predict_x0", False),
        ("thresholding", True),
        ("use_exponential_sigmas", True),
        ("use_beta_sigmas", True),
        ("flow_shift", 0.0),
        ("_class_name", "FlowMatchEulerDiscreteScheduler"),
    ],
)
def test_unsupported_config_is_rejected_naming_the_key(key, value):
    with pytest.raises(InputError, match=key):
        make_schedule(4, {**FLOW_CONFIG, key: value})


@pytest.mark.parametrize("num_steps", [0, -3, 2.5, True, "4"])
def test_bad_num_steps_is_rejected(num_steps):
    with pytest.raises(InputError, match="num_steps"):
        make_schedule(num_steps, FLOW_CONFIG)


@pytest.mark.parametrize("flow_shift", [-1.0, float("inf"), "5"])
def test_flow_shift_override_is_validated(flow_shift):
    with pytest.raises(InputError, match="flow_shift"):
        make_schedule(4, FLOW_CONFIG, flow_shift=flow_shift)


# ---------------------------------------------------------------- trajectories


def fake_velocity(sample, timesteps):
    """A deterministic nonlinear 'model' v(x, t): UniPC's corrector and multistep terms all matter with it."""
    t = timesteps.to(sample.dtype).view(-1, *([1] * (sample.dim() - 1))) / 1000
    return 0.8 * torch.tanh(1.3 * sample + 2.0 * t) - 0.3 * sample * t + 0.1 * torch.sin(3.0 * sample)


def relative_error(ours, reference):
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def initial_noise(batch=1, seed=0):
    return torch.randn(batch, 4, 3, 6, 5, generator=torch.Generator().manual_seed(seed))


TRAJECTORY_CONFIGS = {
    "linear_shift5": FLOW_CONFIG,
    "linear_shift12": {**FLOW_CONFIG, "flow_shift": 12.0},
    "karras_0.01_200": karras_config(0.01, 200.0),
    "karras_0.147_200": karras_config(0.147, 200.0),
    "order1": {**FLOW_CONFIG, "solver_order": 1},
    "order3": {**FLOW_CONFIG, "solver_order": 3, "flow_shift": 3.0},
    "order3_karras": karras_config(0.147, 200.0, solver_order=3),
    "disable_corrector": {**FLOW_CONFIG, "disable_corrector": [0, 2]},
}


@pytest.mark.parametrize("num_steps", [1, 2, 3, 4, 10])
@pytest.mark.parametrize("config_name", list(TRAJECTORY_CONFIGS))
def test_each_step_equals_diffusers_on_the_same_inputs(config_name, num_steps):
    """Both samplers see the same (velocity, sample) at every step, as in Cosmos3OmniPipeline (which steps with
    the timestep and no set_begin_index); every output must match to < 1e-5 relative error."""
    config = TRAJECTORY_CONFIGS[config_name]
    reference = diffusers_scheduler(config, num_steps)
    sampler = FlowUniPCSampler(make_schedule(num_steps, config), "cpu")
    sample = initial_noise()
    for i, timestep in enumerate(reference.timesteps):
        assert torch.equal(sampler.timesteps_for_step(i), timestep.view(1))
        velocity = fake_velocity(sample, timestep.view(1))
        ours = sampler.step(i, velocity, sample)
        expected = reference.step(velocity, timestep, sample).prev_sample
        assert relative_error(ours, expected) < MAX_RELATIVE_ERROR, f"step {i}"
        sample = expected
    assert reference.step_index == num_steps  # diffusers also started at index 0


@pytest.mark.parametrize("num_steps", [1, 2, 3, 4, 10])
@pytest.mark.parametrize("config_name", ["linear_shift5", "karras_0.147_200", "order3"])
def test_free_running_trajectory_equals_diffusers(config_name, num_steps):
    config = TRAJECTORY_CONFIGS[config_name]
    reference = diffusers_scheduler(config, num_steps)
    sampler = FlowUniPCSampler(make_schedule(num_steps, config), "cpu")
    ours = expected = initial_noise()
    for i, timestep in enumerate(reference.timesteps):
        ours = sampler.step(i, fake_velocity(ours, sampler.timesteps_for_step(i)), ours)
        expected = reference.step(fake_velocity(expected, timestep.view(1)), timestep, expected).prev_sample
        assert relative_error(ours, expected) < MAX_RELATIVE_ERROR, f"step {i}"


def test_last_step_returns_the_x0_prediction():
    # lower_order_final + bh2 + sigma_N = 0: x_N = x0(x_{N-1}) = x - sigma * v, exactly.
    schedule = make_schedule(3, FLOW_CONFIG)
    sampler = FlowUniPCSampler(schedule, "cpu")
    sample = initial_noise()
    for i in range(2):
        sample = sampler.step(i, fake_velocity(sample, sampler.timesteps_for_step(i)), sample)
    velocity = fake_velocity(sample, sampler.timesteps_for_step(2))
    final = sampler.step(2, velocity, sample)
    # The corrector changes the sample the last predictor starts from, but the result is its x0, which only
    # depends on the uncorrected sample and velocity.
    assert torch.equal(final, sample - torch.tensor(schedule.sigmas[2]) * velocity)


def test_duplicated_first_timestep_we_start_at_index_zero():
    """At shift 12 with 100 steps the first two timesteps are both 999. Without set_begin_index (as
    Cosmos3OmniPipeline) diffusers then starts at index 1; we always start at 0 = diffusers with set_begin_index(0)."""
    config = {**FLOW_CONFIG, "flow_shift": 12.0}
    schedule = make_schedule(100, config)
    assert schedule.timesteps[0] == schedule.timesteps[1] == 999
    by_lookup = diffusers_scheduler(config, 100)
    from_zero = diffusers_scheduler(config, 100)
    from_zero.set_begin_index(0)
    sampler = FlowUniPCSampler(schedule, "cpu")
    sample = initial_noise()
    for i in range(3):
        timestep = from_zero.timesteps[i]
        velocity = fake_velocity(sample, timestep.view(1))
        ours = sampler.step(i, velocity, sample)
        expected = from_zero.step(velocity, timestep, sample).prev_sample
        assert relative_error(ours, expected) < MAX_RELATIVE_ERROR
        sample = expected
    by_lookup.step(fake_velocity(initial_noise(), by_lookup.timesteps[:1]), by_lookup.timesteps[0], initial_noise())
    assert by_lookup.step_index == 2  # it skipped index 0


@pytest.mark.parametrize("num_steps", [4, 10])
def test_batch_of_mixed_schedules_equals_each_alone(num_steps):
    schedules = [
        make_schedule(num_steps, FLOW_CONFIG),
        make_schedule(num_steps, karras_config(0.147, 200.0)),
        make_schedule(num_steps, FLOW_CONFIG, flow_shift=10.0),
    ]
    noise = initial_noise(batch=len(schedules))
    batched = FlowUniPCSampler(schedules, "cpu")
    alone = [FlowUniPCSampler(schedule, "cpu") for schedule in schedules]
    batch_sample = noise
    single_samples = list(noise.split(1))
    for i in range(num_steps):
        timesteps = batched.timesteps_for_step(i)
        assert timesteps.tolist() == [int(schedule.timesteps[i]) for schedule in schedules]
        batch_sample = batched.step(i, fake_velocity(batch_sample, timesteps), batch_sample)
        for item, sampler in enumerate(alone):
            x = single_samples[item]
            single_samples[item] = sampler.step(i, fake_velocity(x, sampler.timesteps_for_step(i)), x)
        assert torch.equal(batch_sample, torch.cat(single_samples))


def test_reset_restarts_the_trajectory():
    sampler = FlowUniPCSampler(make_schedule(3, FLOW_CONFIG), "cpu")

    def run():
        sample = initial_noise()
        for i in range(3):
            sample = sampler.step(i, fake_velocity(sample, sampler.timesteps_for_step(i)), sample)
        return sample

    first = run()
    with pytest.raises(ValueError, match="reset"):
        sampler.step(0, first, first)  # the trajectory is finished
    sampler.reset()
    assert torch.equal(run(), first)


def test_misuse_is_rejected():
    with pytest.raises(InputError, match="num_steps"):
        FlowUniPCSampler([make_schedule(4, FLOW_CONFIG), make_schedule(5, FLOW_CONFIG)], "cpu")
    sampler = FlowUniPCSampler(make_schedule(4, FLOW_CONFIG), "cpu")
    sample = initial_noise()
    with pytest.raises(ValueError, match="expected i=0"):
        sampler.step(1, sample, sample)
    with pytest.raises(ValueError, match="must both be"):
        sampler.step(0, initial_noise(batch=2), initial_noise(batch=2))


def test_bf16_sample_math_in_fp32_result_in_sample_dtype():
    sampler = FlowUniPCSampler(make_schedule(2, FLOW_CONFIG), "cpu")
    reference = FlowUniPCSampler(make_schedule(2, FLOW_CONFIG), "cpu")
    sample = initial_noise().bfloat16()
    velocity = fake_velocity(sample.float(), sampler.timesteps_for_step(0)).bfloat16()
    out = sampler.step(0, velocity, sample)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference.step(0, velocity.float(), sample.float()).bfloat16())


# ---------------------------------------------------------------- no host sync


def test_step_does_no_host_sync_or_value_branching(monkeypatch):
    """Every value-reading escape hatch of torch.Tensor raises during the steps, and the whole loop also runs on the
    meta device (which has no values at all): step's control flow depends only on Python ints."""
    schedules = [make_schedule(4, FLOW_CONFIG), make_schedule(4, karras_config(0.147, 200.0))]
    cpu_sampler = FlowUniPCSampler(schedules, "cpu")
    meta_sampler = FlowUniPCSampler(schedules, "meta")
    for table in (meta_sampler._predictor, meta_sampler._corrector):
        for coefficients in (table.sample_coef, table.anchor_x0_coef, table.history_coefs, table.new_x0_coef):
            assert coefficients.device.type == "meta"

    def host_read(*args, **kwargs):
        raise AssertionError("step() read a tensor value on the host")

    for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    cpu_sample = initial_noise(batch=2)
    meta_sample = torch.empty(cpu_sample.shape, device="meta")
    for i in range(4):
        cpu_sample = cpu_sampler.step(i, fake_velocity(cpu_sample, cpu_sampler.timesteps_for_step(i)), cpu_sample)
        meta_sample = meta_sampler.step(i, meta_sample * 0.5, meta_sample)
    assert meta_sample.shape == cpu_sample.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_does_no_host_sync_on_cuda():
    for config in (FLOW_CONFIG, karras_config(0.147, 200.0, solver_order=3)):
        num_steps = 10
        sampler = FlowUniPCSampler([make_schedule(num_steps, config)] * 2, "cuda")
        sample = initial_noise(batch=2).cuda()
        reference = diffusers_scheduler(config, num_steps)
        expected = initial_noise(batch=2).cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(num_steps):
                sample = sampler.step(i, fake_velocity(sample, sampler.timesteps_for_step(i)), sample)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for timestep in reference.timesteps:
            velocity = fake_velocity(expected, timestep.view(1).cuda())
            expected = reference.step(velocity, timestep, expected).prev_sample
        assert relative_error(sample, expected) < MAX_RELATIVE_ERROR


# ---------------------------------------------------------------- CFG


def test_cfg_combine_float_matches_cosmos3_pipeline():
    cond, uncond = initial_noise(seed=1), initial_noise(seed=2)
    assert torch.equal(cfg_combine(cond, uncond, 3.0), uncond + 3.0 * (cond - uncond))
    assert cfg_combine(cond, uncond, 1.0) is cond
    assert cfg_combine(cond, None, 1.0) is cond  # the pipeline skips the uncond pass at 1.0
    with pytest.raises(InputError, match="guidance_scale"):
        cfg_combine(cond, None, 3.0)


def test_cfg_combine_per_request_tensor():
    cond, uncond = initial_noise(batch=3, seed=1), initial_noise(batch=3, seed=2)
    scales = [3.0, 1.0, 7.5]
    combined = cfg_combine(cond, uncond, torch.tensor(scales))
    for item, scale in enumerate(scales):
        assert torch.equal(combined[item], cfg_combine(cond[item], uncond[item], scale))
    assert torch.equal(combined[1], cond[1])
    with pytest.raises(InputError, match="guidance_scale"):
        cfg_combine(cond, uncond, torch.tensor([3.0, 1.0]))
    with pytest.raises(InputError, match="guidance_scale"):
        cfg_combine(cond, None, torch.tensor(scales))


def test_shared_schedule_objects_equal_a_batch_of_distinct_ones():
    """A batch that repeats a few Schedule objects (a vector env's slots share one) is checked and stacked once per
    distinct object; its tables and steps equal those of the same batch made of distinct copies."""
    import copy

    a, b, c = (make_schedule(4, FLOW_CONFIG), make_schedule(4, FLOW_CONFIG, flow_shift=10.0),
               make_schedule(4, karras_config(0.147, 200.0)))
    shared = [a, b, a, a, c, b, a]
    shared_sampler = FlowUniPCSampler(shared, "cpu")
    copies_sampler = FlowUniPCSampler([copy.deepcopy(s) for s in shared], "cpu")
    assert shared_sampler.batch_size == copies_sampler.batch_size == len(shared)
    pairs = [(shared_sampler._timesteps, copies_sampler._timesteps)]
    pairs.append((shared_sampler._x0_sigma, copies_sampler._x0_sigma))
    for name in ("sample_coef", "anchor_x0_coef", "history_coefs", "new_x0_coef"):
        for table in ("_predictor", "_corrector"):
            pairs.append((getattr(getattr(shared_sampler, table), name), getattr(getattr(copies_sampler, table), name)))
    for ours, expected in pairs:
        assert ours.dtype == expected.dtype and ours.shape == expected.shape and torch.equal(ours, expected)
    x = y = initial_noise(batch=len(shared))
    for i in range(4):
        x = shared_sampler.step(i, fake_velocity(x, shared_sampler.timesteps_for_step(i)), x)
        y = copies_sampler.step(i, fake_velocity(y, copies_sampler.timesteps_for_step(i)), y)
        assert torch.equal(x, y)
    # a mismatch is named at its first batch index, as when every item was checked
    with pytest.raises(InputError, match=r"schedules\[3\]"):
        FlowUniPCSampler([a, b, a, make_schedule(5, FLOW_CONFIG), b], "cpu")
