"""A vLLM plugin for the tests: a GEMM for 128x128 block-scaled FP8 weights on
CPUs without AMX, where vLLM 0.32 has none (its CPU block kernels need AMX
tiles, so an engine with quantization="fp8_per_block" fails to build its
layers here).

Only the matrix product is the test's: the weights are quantized by vLLM's
own Fp8PerBlockOnlineLinearMethod.process_weights_after_loading and then
processed by the block kernels' own base class (what vLLM's GPU block
kernels inherit), so the codes and scales the engine holds are vLLM's. The
product dequantizes the weight block by block and multiplies the BF16
activations in F32 (W8A16, as vLLM's AMX W8A16 kernel does). It is a
stand-in for the GPU kernels: generation with it proves that the weights
drive an engine, not what a GPU's FP8 GEMM computes.

tests/python/vllm_test.py installs it as an entry point of the
`vllm.general_plugins` group, so that every process of an engine loads it.
"""
from __future__ import annotations

import torch


def register() -> None:
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel)
    from vllm.platforms import PlatformEnum, current_platform

    class DequantizedBlockFp8Kernel(Fp8BlockScaledMMLinearKernel):
        apply_input_quant = False  # BF16 activations

        @classmethod
        def is_supported(cls, compute_capability=None):
            return (True, None) if current_platform.is_cpu() else (False, "the tests' CPU stand-in")

        def apply_block_scaled_mm(self, A: torch.Tensor, B: torch.Tensor, As: torch.Tensor,
                                  Bs: torch.Tensor) -> torch.Tensor:
            n, k = B.shape
            bn, bk = self.weight_group_shape  # the weight's block: 128 x 128
            scale = Bs.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            return A.float() @ (B.float() * scale).t()

    kernels = _POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if not any(k.__name__ == DequantizedBlockFp8Kernel.__name__ for k in kernels):
        kernels.insert(0, DequantizedBlockFp8Kernel)
