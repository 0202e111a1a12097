"""Flow-matching UniPC sampling for the Cosmos3 denoising loop, free of host syncs.

This is the project's port of diffusers' ``UniPCMultistepScheduler`` (flow prediction, ``use_flow_sigmas``,
predict-x0, bh2, ``final_sigmas_type="zero"``, ``lower_order_final``), the scheduler ``Cosmos3OmniPipeline`` steps.
diffusers keeps the sigmas on the CPU, finds the first step index with ``nonzero()`` and calls
``torch.linalg.solve`` on the device in every corrector step of order >= 2: each of these syncs with the host inside
the denoising loop. Every UniPC coefficient depends only on the sigma grid, so :func:`make_schedule` computes all of
them once, on the host in float64, and :meth:`FlowUniPCSampler.step` is a few float32 element-wise tensor ops
(no ``.item()``, no indexing by tensor values, no branching on tensor values): it can be captured in a CUDA graph.

Notation (diffusers' flow parametrisation): alpha = 1 - sigma, lambda = log(alpha) - log(sigma) (+inf at sigma 0),
the model predicts the velocity v and x0 = x - sigma * v. Every UniPC update, predictor or corrector, is linear:

    x_target = a * x_anchor + b * m_anchor + sum_k w_k * (m_{anchor-k} - m_anchor) [+ w_new * (m_new - m_anchor)]

where m are x0 predictions. ``UpdateTable`` stores a, b, w_k and w_new for every step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from diffusers import UniPCMultistepScheduler

from cosmos3_gym.errors import InputError

# Orders proven equal to diffusers in tests/test_sampling.py.
SUPPORTED_SOLVER_ORDERS = (1, 2, 3)


@dataclasses.dataclass(frozen=True, eq=False)
class UpdateTable:
    """Coefficients of one kind of UniPC update (predictor or corrector) for every step, float64 on the host.

    At step i the update reads ``order[i]`` x0 predictions: the anchor m_anchor plus ``order[i] - 1`` older ones.
    ``order[i] == 0`` means the update does not run at step i (the corrector at step 0, or a disabled corrector).
    """

    order: np.ndarray  # int64 [N]
    sample_coef: np.ndarray  # [N]: a, multiplies the anchor sample
    anchor_x0_coef: np.ndarray  # [N]: b, multiplies m_anchor
    history_coefs: np.ndarray  # [N, solver_order - 1]: w_k, multiply (m_{anchor-k} - m_anchor), k = 1, 2, ...
    new_x0_coef: np.ndarray  # [N]: w_new, multiplies (m_new - m_anchor); corrector only (zeros for the predictor)


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """The sigma/timestep grid of one request and the UniPC coefficients of every step.

    ``sigmas`` and ``timesteps`` are exactly what ``UniPCMultistepScheduler.set_timesteps`` stores (float32 sigmas
    with the final 0 appended; int64 timesteps, the truncation of sigma * num_train_timesteps).
    """

    num_steps: int
    solver_order: int
    flow_shift: float
    use_karras_sigmas: bool
    sigmas: np.ndarray  # float32 [N + 1], sigmas[N] == 0
    timesteps: np.ndarray  # int64 [N]
    predictor: UpdateTable  # x_i (corrected) -> x_{i+1}
    corrector: UpdateTable  # UniC: re-estimates x_i from x_{i-1} once m_i is known


NUM_TRAIN_TIMESTEPS = 1000  # the scheduler's num_train_timesteps: the model's timestep is int(sigma * 1000)


def timesteps_from_sigmas(sigmas: torch.Tensor) -> torch.Tensor:
    """The model timesteps: int64 truncation of sigma * 1000, as the sampler's ``timesteps``."""
    return (sigmas.double() * NUM_TRAIN_TIMESTEPS).to(torch.int64)


def make_schedule(
    num_steps: int,
    scheduler_config: Mapping,
    *,
    flow_shift: float | None = None,
    use_karras_sigmas: bool | None = None,
    use_native_flow_schedule: bool = False,
) -> Schedule:
    """Build the grid that ``UniPCMultistepScheduler.from_config(config)`` + ``set_timesteps(num_steps)`` produces.

    ``flow_shift`` overrides the config's ``flow_shift`` (linear flow sigmas only: diffusers ignores it with Karras
    sigmas). ``use_karras_sigmas`` overrides the config's flag: True gives Karras sigmas over
    [config sigma_min, config sigma_max] (rho 7) mapped to flow by s / (1 + s); False gives linear flow sigmas
    ``shift(linspace(1, 1/T, N + 1)[:-1])`` with sigma 1 lowered by 1e-6. ``use_native_flow_schedule`` mirrors
    ``Cosmos3OmniPipeline``'s flag of that name: it passes ``sigmas=linspace(1 - 1/T, 0, N + 1)[:-1]`` (the native
    cosmos-framework grid) to ``set_timesteps``, which the linear flow grid shifts instead of
    ``linspace(1, 1/T, N + 1)[:-1]`` and which Karras sigmas ignore when the config sets sigma_min and sigma_max.

    The grid itself comes from diffusers (its ``set_timesteps`` on the host, so every config detail such as
    ``shift_terminal`` or the sigma-1 adjustment matches by construction); the coefficients are ours.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 1:
        raise InputError(f"num_steps: expected an integer >= 1, got {num_steps!r}")
    num_steps = int(num_steps)

    config = dict(scheduler_config)
    class_name = config.get("_class_name", UniPCMultistepScheduler.__name__)
    if class_name != UniPCMultistepScheduler.__name__:
        raise InputError(f"scheduler_config._class_name: expected 'UniPCMultistepScheduler', got {class_name!r}")
    if flow_shift is not None:
        config["flow_shift"] = flow_shift
    if use_karras_sigmas is not None:
        config["use_karras_sigmas"] = bool(use_karras_sigmas)
    # Checked before diffusers sees the config: its beta sigmas need scipy and would fail with an unrelated message.
    for key in ("use_beta_sigmas", "use_exponential_sigmas"):
        if config.get(key):
            raise InputError(f"scheduler_config.{key}: expected False, got {config[key]!r}")
    try:
        scheduler = UniPCMultistepScheduler.from_config(config)
    except (ValueError, TypeError, NotImplementedError, ImportError) as error:
        raise InputError(f"scheduler_config: diffusers' UniPCMultistepScheduler rejects it: {error}") from error
    resolved = scheduler.config
    _check_supported(resolved)

    if use_native_flow_schedule:
        native_sigmas = np.linspace(1.0 - 1.0 / resolved.num_train_timesteps, 0.0, num_steps + 1)[:-1]
        scheduler.set_timesteps(num_steps, device="cpu", sigmas=native_sigmas)
    else:
        scheduler.set_timesteps(num_steps, device="cpu")
    sigmas = scheduler.sigmas.numpy().astype(np.float32)
    timesteps = scheduler.timesteps.numpy().astype(np.int64)
    if sigmas.shape != (num_steps + 1,) or sigmas[-1] != 0 or not np.all(np.diff(sigmas) < 0):
        raise InputError(
            f"scheduler_config: the sigma grid for num_steps={num_steps} must be {num_steps + 1} strictly "
            f"decreasing values ending at 0, got {sigmas.tolist()} (check flow_shift, sigma_min, sigma_max)"
        )

    predictor, corrector = _unipc_tables(
        sigmas,
        solver_order=resolved.solver_order,
        disable_corrector=frozenset(int(step) for step in resolved.disable_corrector),
    )
    return Schedule(
        num_steps=num_steps,
        solver_order=resolved.solver_order,
        flow_shift=float(resolved.flow_shift),
        use_karras_sigmas=bool(resolved.use_karras_sigmas),
        sigmas=_read_only(sigmas),
        timesteps=_read_only(timesteps),
        predictor=predictor,
        corrector=corrector,
    )


def _check_supported(config) -> None:
    """Reject scheduler configs this port does not reproduce (the message names the key)."""

    def reject(key: str, expected: str) -> None:
        raise InputError(f"scheduler_config.{key}: expected {expected}, got {config[key]!r}")

    if config.prediction_type != "flow_prediction":
        reject("prediction_type", "'flow_prediction' (Cosmos3 predicts the flow velocity)")
    if not config.use_flow_sigmas:
        reject("use_flow_sigmas", "True")
    if config.use_exponential_sigmas:
        reject("use_exponential_sigmas", "False")
    if config.use_beta_sigmas:
        reject("use_beta_sigmas", "False")
    if config.use_dynamic_shifting:
        reject("use_dynamic_shifting", "False (no dynamic shifting support)")
    if config.final_sigmas_type != "zero":
        reject("final_sigmas_type", "'zero'")
    if config.solver_type != "bh2":
        # With flow sigmas ending at 0, bh1's last update multiplies B(h) = -inf by 0: diffusers returns NaN.
        reject("solver_type", "'bh2' (bh1 gives NaN at the final sigma 0)")
    if config.solver_order not in SUPPORTED_SOLVER_ORDERS:
        reject("solver_order", f"one of {SUPPORTED_SOLVER_ORDERS}")
    if not config.lower_order_final and config.solver_order > 1:
        # Without it the last update (h = +inf) divides by r_k = 0: diffusers returns inf/NaN.
        reject("lower_order_final", "True (the last step to sigma 0 must be first order)")
    if not config.predict_x0:
        reject("predict_x0", "True")
    if config.thresholding:
        reject("thresholding", "False")
    flow_shift = config.flow_shift
    valid_shift = isinstance(flow_shift, (int, float)) and not isinstance(flow_shift, bool)
    if not config.use_karras_sigmas and not (valid_shift and math.isfinite(flow_shift) and flow_shift > 0):
        reject("flow_shift", "a finite number > 0")


def _unipc_tables(
    sigmas: np.ndarray, *, solver_order: int, disable_corrector: frozenset
) -> tuple[UpdateTable, UpdateTable]:
    """Precompute diffusers' ``multistep_uni_p_bh_update`` / ``multistep_uni_c_bh_update`` coefficients (bh2)."""
    num_steps = len(sigmas) - 1
    sigma = sigmas.astype(np.float64)
    alpha = 1.0 - sigma  # exact: sigma is a float32 value
    with np.errstate(divide="ignore"):
        lambdas = np.log(alpha) - np.log(sigma)  # lambdas[N] = +inf

    def update(anchor: int, target: int, order: int, corrector: bool) -> tuple[float, float, list[float], float]:
        """One update from the anchor step to the target step, reading ``order - 1`` x0s older than the anchor."""
        h = lambdas[target] - lambdas[anchor]
        hh = -h  # predict_x0
        h_phi_1 = np.expm1(hh)
        b_h = np.expm1(hh)  # B(h), bh2 variant
        ratios = [(lambdas[anchor - k] - lambdas[anchor]) / h for k in range(1, order)]
        # diffusers' R (rows r^(k-1), with r = [ratios..., 1]) and b (phi-function recursion).
        r_all = np.array(ratios + [1.0])
        r_matrix = np.stack([r_all ** (k - 1) for k in range(1, order + 1)])
        b_terms = []
        h_phi_k = h_phi_1 / hh - 1
        factorial = 1
        for k in range(1, order + 1):
            b_terms.append(h_phi_k * factorial / b_h)
            factorial *= k + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        b_vector = np.array(b_terms)
        if corrector:
            # diffusers fixes rho = 0.5 for a first-order corrector instead of solving.
            rhos = [0.5] if order == 1 else list(np.linalg.solve(r_matrix, b_vector))
        elif order == 1:
            rhos = []
        elif order == 2:
            rhos = [0.5]  # diffusers' hard-coded order-2 predictor
        else:
            rhos = list(np.linalg.solve(r_matrix[:-1, :-1], b_vector[:-1]))
        residual_coef = -alpha[target] * b_h
        sample_coef = sigma[target] / sigma[anchor]
        anchor_x0_coef = -alpha[target] * h_phi_1
        history = [residual_coef * rho / ratio for rho, ratio in zip(rhos[: order - 1], ratios)]
        new_x0_coef = residual_coef * rhos[-1] if corrector else 0.0
        return sample_coef, anchor_x0_coef, history, new_x0_coef

    def empty_table() -> dict:
        return {
            "order": np.zeros(num_steps, np.int64),
            "sample_coef": np.zeros(num_steps),
            "anchor_x0_coef": np.zeros(num_steps),
            "history_coefs": np.zeros((num_steps, solver_order - 1)),
            "new_x0_coef": np.zeros(num_steps),
        }

    def fill(table: dict, step: int, order: int, coefs: tuple) -> None:
        table["order"][step] = order
        sample_coef, anchor_x0_coef, history, new_x0_coef = coefs
        table["sample_coef"][step] = sample_coef
        table["anchor_x0_coef"][step] = anchor_x0_coef
        table["history_coefs"][step, : len(history)] = history
        table["new_x0_coef"][step] = new_x0_coef

    predictor, corrector = empty_table(), empty_table()
    for step in range(num_steps):
        # diffusers: lower_order_final caps the order near the end, lower_order_nums warms it up at the start.
        predictor_order = min(solver_order, num_steps - step, step + 1)
        fill(predictor, step, predictor_order, update(step, step + 1, predictor_order, corrector=False))
        # The corrector at step i uses the order of the predictor that produced x_i (diffusers' self.this_order).
        if step > 0 and step - 1 not in disable_corrector:
            corrector_order = int(predictor["order"][step - 1])
            fill(corrector, step, corrector_order, update(step - 1, step, corrector_order, corrector=True))
    return (
        UpdateTable(**{name: _read_only(values) for name, values in predictor.items()}),
        UpdateTable(**{name: _read_only(values) for name, values in corrector.items()}),
    )


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


class _DeviceTable:
    """An ``UpdateTable`` for a batch of schedules as float32 device tensors, batch last: [N, B] and [N, K, B].

    ``items``: each batch item's index in ``tables``, so that a batch of few distinct schedules stacks each once."""

    def __init__(self, tables: Sequence[UpdateTable], device: torch.device, items: np.ndarray):
        def stack(name: str) -> torch.Tensor:
            values = np.stack([getattr(table, name) for table in tables], axis=-1)[..., items]
            return torch.tensor(values, dtype=torch.float32, device=device)

        self.order = [int(order) for order in tables[0].order]  # identical across the batch (checked by caller)
        self.sample_coef = stack("sample_coef")
        self.anchor_x0_coef = stack("anchor_x0_coef")
        self.history_coefs = stack("history_coefs")
        self.new_x0_coef = stack("new_x0_coef")


class FlowUniPCSampler:
    """Steps B samples in lockstep with diffusers' UniPC (flow prediction), each with its own :class:`Schedule`.

    All schedules need the same ``num_steps`` and ``solver_order`` (hence the same update orders), but may differ
    in flow_shift / Karras. Call ``step(i, ...)`` for i = 0, 1, ..., N-1 in order; ``reset()`` starts over.

    Index bookkeeping: we always start at step index 0. ``Cosmos3OmniPipeline`` does not call
    ``set_begin_index``, so diffusers finds its first index by looking the first timestep up in the int64
    timesteps and, on a duplicate (e.g. [999, 999, ...] at flow_shift 12 with 100 steps), takes the second match,
    silently skipping step 0. For grids without a duplicated first timestep both agree (tested).
    """

    def __init__(self, schedules: Schedule | Sequence[Schedule], device: torch.device | str):
        schedules = [schedules] if isinstance(schedules, Schedule) else list(schedules)
        if not schedules:
            raise InputError("schedules: expected at least one Schedule")
        # A batch holds few distinct Schedule objects (the engine's are cached per setting: a vector env's slots share
        # one), so each distinct one is checked and stacked once and the batch's [.., B] arrays are picked from those
        # by index: the same values as stacking every item's (at 256 slots the per-item checks and stacks were ~10 ms
        # of host time a step). Distinct by identity: equal schedules that are different objects just stack twice.
        first_index: dict[int, int] = {}  # id -> the batch index where it first appears
        for index, schedule in enumerate(schedules):
            first_index.setdefault(id(schedule), index)
        position = {schedule_id: i for i, schedule_id in enumerate(first_index)}  # id -> its place among the distinct
        items = np.array([position[id(schedule)] for schedule in schedules], dtype=np.int64)
        batch_size = len(schedules)
        indexed = [(index, schedules[index]) for index in first_index.values()]
        schedules = [schedule for _, schedule in indexed]
        first = schedules[0]
        # a failing schedule fails at its first appearance: the error names the same item as a check of every item
        for index, schedule in indexed:
            if schedule.num_steps != first.num_steps or schedule.solver_order != first.solver_order:
                raise InputError(
                    f"schedules[{index}]: every batch item needs the same num_steps and solver_order, got "
                    f"({schedule.num_steps}, {schedule.solver_order}) vs ({first.num_steps}, {first.solver_order})"
                )
            if not (
                np.array_equal(schedule.corrector.order, first.corrector.order)
                and np.array_equal(schedule.predictor.order, first.predictor.order)
            ):
                raise InputError(f"schedules[{index}]: every batch item needs the same disable_corrector steps")
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.num_steps = first.num_steps
        self._solver_order = first.solver_order
        self._timesteps = torch.tensor(
            np.stack([s.timesteps for s in schedules], axis=-1)[:, items], device=self.device
        )
        sigmas = np.stack([s.sigmas[:-1] for s in schedules], axis=-1)[:, items]
        self._x0_sigma = torch.tensor(sigmas, dtype=torch.float32, device=self.device)  # [N, B]
        self._predictor = _DeviceTable([s.predictor for s in schedules], self.device, items)
        self._corrector = _DeviceTable([s.corrector for s in schedules], self.device, items)
        self.reset()

    def reset(self) -> None:
        """Forget the trajectory so that the next call is ``step(0, ...)``."""
        self._x0_history: list[torch.Tensor] = []  # newest last, at most solver_order entries
        self._last_sample: torch.Tensor | None = None  # the (corrected) sample the last predictor started from
        self._next_step = 0

    def timesteps_for_step(self, i: int) -> torch.Tensor:
        """The int64 model timesteps [B] of step i, on the device."""
        return self._timesteps[i]

    def step(self, i: int, velocity: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """Advance from step i to i+1 given the (guided) velocity at step i; returns the next sample.

        Math runs in float32; the result has ``sample``'s dtype (as diffusers). ``velocity`` and ``sample`` are
        [B, ...] with B the number of schedules; coefficients broadcast over the trailing dims.
        """
        if i != self._next_step:
            if self._next_step == self.num_steps:
                raise ValueError(f"step: all {self.num_steps} steps are done; call reset() to start over (got i={i})")
            raise ValueError(
                f"step: expected i={self._next_step} (steps run 0..{self.num_steps - 1} in order), got {i}"
            )
        if velocity.shape != sample.shape or sample.shape[0] != self.batch_size:
            raise ValueError(
                f"step: velocity {tuple(velocity.shape)} and sample {tuple(sample.shape)} must both be "
                f"[{self.batch_size}, ...]"
            )
        output_dtype = sample.dtype
        sample = sample.float()
        x0 = sample - self._per_item(self._x0_sigma[i], sample) * velocity.float()

        if self._corrector.order[i] > 0:
            assert self._last_sample is not None  # no corrector at step 0; later steps follow a predictor
            sample = self._update(self._corrector, i, self._last_sample, new_x0=x0)
        self._x0_history = (self._x0_history + [x0])[-self._solver_order :]
        self._last_sample = sample
        next_sample = self._update(self._predictor, i, sample, new_x0=None)

        self._next_step += 1
        return next_sample.to(output_dtype)

    def _update(self, table: _DeviceTable, i: int, sample: torch.Tensor, new_x0: torch.Tensor | None) -> torch.Tensor:
        """``a*x + b*m_anchor + sum_k w_k (m_{anchor-k} - m_anchor) [+ w_new (m_new - m_anchor)]`` at step i."""
        anchor_x0 = self._x0_history[-1]
        result = self._per_item(table.sample_coef[i], sample) * sample
        result = result + self._per_item(table.anchor_x0_coef[i], sample) * anchor_x0
        for k in range(1, table.order[i]):
            older_x0 = self._x0_history[-1 - k]
            result = result + self._per_item(table.history_coefs[i, k - 1], sample) * (older_x0 - anchor_x0)
        if new_x0 is not None:
            result = result + self._per_item(table.new_x0_coef[i], sample) * (new_x0 - anchor_x0)
        return result

    @staticmethod
    def _per_item(coefficient: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """View a [B] coefficient as [B, 1, ..., 1] to broadcast over ``like``'s trailing dims."""
        return coefficient.view(-1, *([1] * (like.dim() - 1)))


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor | None, guidance_scale: float | torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance as ``Cosmos3OmniPipeline``: ``uncond + g * (cond - uncond)``, and ``cond`` when g == 1.

    ``guidance_scale`` is a float (``uncond`` may be None when it is 1.0: the pipeline skips the uncond pass) or a
    [B] tensor of per-request scales broadcast over the trailing dims; rows with g == 1 return ``cond`` exactly,
    selected on the device (no host sync), so ``uncond`` is required with a tensor.
    """
    if not isinstance(guidance_scale, torch.Tensor):
        if guidance_scale == 1.0:
            return cond
        if uncond is None:
            raise InputError(f"guidance_scale: {guidance_scale} != 1.0 needs the unconditional velocity, got None")
        return uncond + guidance_scale * (cond - uncond)
    if uncond is None:
        raise InputError("guidance_scale: a per-request tensor needs the unconditional velocity, got None")
    if guidance_scale.shape != (cond.shape[0],):
        raise InputError(f"guidance_scale: expected shape [{cond.shape[0]}], got {tuple(guidance_scale.shape)}")
    scale = guidance_scale.to(device=cond.device, dtype=cond.dtype).view(-1, *([1] * (cond.dim() - 1)))
    return torch.where(scale == 1.0, cond, uncond + scale * (cond - uncond))
