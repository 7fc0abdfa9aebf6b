"""A vLLM plugin for the tests: what vLLM 0.32 lacks on CPUs without AMX to
run FP8 engines other than per channel.

- A GEMM for 128x128 block-scaled FP8 weights (vLLM's CPU block kernels
  need AMX tiles, so an engine with quantization="fp8_per_block" fails to
  build its layers here). Only the product is the test's: the weights are
  quantized by vLLM's own Fp8PerBlockOnlineLinearMethod and processed by the
  block kernels' own base class (what vLLM's GPU block kernels inherit), so
  the codes and scales the engine holds are vLLM's. The product dequantizes
  the weight block by block and multiplies the BF16 activations in F32
  (W8A16, as vLLM's AMX W8A16 kernel does).
- Static per-tensor quantization (ops.scaled_fp8_quant with a scale), whose
  kernel has no CPU build: vLLM's own pure-torch form of it
  (QuantFP8.forward_native), in the engine and in the trainer alike.

Both are stand-ins: generation with them proves that the weights drive an
engine, not what a GPU computes, and the per-tensor codes are those of
vLLM's native form. scripts/gpu_check.sh runs the same engines on vLLM's GPU
kernels.

tests/python/vllm_test.py installs it as an entry point of the
`vllm.general_plugins` group, so that every process loads it.
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
            return A.float() @ _dequantized(B, Bs, tuple(self.weight_group_shape)).t()  # blocks: 128 x 128

    kernels = _POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if not any(k.__name__ == DequantizedBlockFp8Kernel.__name__ for k in kernels):
        kernels.insert(0, DequantizedBlockFp8Kernel)
    _static_per_tensor_quant_on_cpu()
    _block_experts_on_cpu()


def _block_experts_on_cpu() -> None:
    """Experts of 128x128 block-scaled FP8 weights on the CPU: vLLM's FP8
    MoE backend choice answers Triton's (whose load-time format is the
    method's own) with experts that dequantize each expert's weights block
    by block and run it in F32."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsFp8
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.quantization.online import fp8 as online
    from vllm.platforms import current_platform
    if not current_platform.is_cpu() or getattr(online.select_fp8_moe_backend, "wsync_test", False):
        return
    select = online.select_fp8_moe_backend

    class DequantizedBlockFp8Experts(CPUExpertsFp8):
        @staticmethod
        def _supports_current_device() -> bool:
            return True

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            x = hidden_states.float()
            out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
            for e in topk_ids.unique().tolist():
                local = e if expert_map is None else int(expert_map[e])
                if local < 0:
                    continue
                rows, slot = (topk_ids == e).nonzero(as_tuple=True)
                up = x[rows] @ _dequantized(w1[local], self.w1_scale[local]).t()
                half = up.shape[1] // 2
                act = torch.nn.functional.silu(up[:, :half]) * up[:, half:]
                down = act @ _dequantized(w2[local], self.w2_scale[local]).t()
                out.index_add_(0, rows, down * topk_weights[rows, slot].float().unsqueeze(1))
            output.copy_(out.to(output.dtype))

    def select_on_cpu(config, weight_key, activation_key, allow_vllm_cutlass=False):
        from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8Static128BlockSym
        if weight_key == kFp8Static128BlockSym:
            return Fp8MoeBackend.TRITON, DequantizedBlockFp8Experts
        return select(config, weight_key, activation_key, allow_vllm_cutlass)
    select_on_cpu.wsync_test = True
    online.select_fp8_moe_backend = select_on_cpu


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """An (N, K) weight from its E4M3 codes and one scale per block."""
    n, k = codes.shape
    return codes.float() * scales.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def _static_per_tensor_quant_on_cpu() -> None:
    """ops.scaled_fp8_quant with a per-tensor scale on the CPU, where its
    kernel is missing: vLLM's QuantFP8.forward_native."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape
    from vllm.platforms import current_platform
    if not current_platform.is_cpu() or getattr(ops.scaled_fp8_quant, "wsync_test", False):
        return
    kernel = ops.scaled_fp8_quant

    def native():
        # A CustomOp reads vLLM's configuration when made: the engine's where there is one (in its
        # processes), a default one in the trainer's.
        from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
        if get_current_vllm_config_or_none() is not None:
            return QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
        with set_current_vllm_config(VllmConfig()):
            return QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)

    def scaled_fp8_quant(input, scale=None, num_token_padding=None, scale_ub=None, use_per_token_if_dynamic=False,
                         output=None, group_shape=None):
        if scale is None or scale.numel() != 1 or num_token_padding or output is not None:
            return kernel(input, scale, num_token_padding, scale_ub, use_per_token_if_dynamic, output, group_shape)
        codes, _ = native().forward_native(input, scale.reshape(1))
        return codes, scale
    scaled_fp8_quant.wsync_test = True
    ops.scaled_fp8_quant = scaled_fp8_quant
