"""The arithmetic of benchmarks/profile_gpu.py (the profile itself needs a GPU to mean anything)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    import profile_gpu
finally:
    sys.path.pop(0)


def test_busy_time_is_the_union_of_kernel_intervals():
    assert profile_gpu.busy_us([]) == 0.0
    # two streams overlapping (0-10 and 5-12), one kernel inside another (20-30 holds 22-25), a gap (12-20)
    assert profile_gpu.busy_us([(20, 30), (0, 10), (22, 25), (5, 12)]) == pytest.approx(22.0)


@pytest.mark.parametrize("name, expected", [
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "triton"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "nccl"),
    ("Memcpy HtoD (Pageable -> Device)", "memcpy_memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
])
def test_kernel_classes(name, expected):
    assert profile_gpu.kernel_class(name) == expected
