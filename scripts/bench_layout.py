"""What deriving a rank's layout from vLLM's loader costs, for model shapes
too large to load on this machine: the vLLM model is built on the meta
device (no memory for its weights) in this one process (TP 1: the rank that
holds every expert), the checkpoint's tensor list comes from transformers'
own model of the same config (also on the meta device), and the time and
the peak memory of wsync.vllm.loader.derive_layout are printed, medians of
--repeat runs.

    <vLLM python> scripts/bench_layout.py --build build [--configs 7b,moe-100b] [--repeat 3]

Configurations: `7b` (Llama-shaped, 32 layers, 4096 hidden), `moe-100b`
(DeepSeek-V2-shaped: latent attention, 60 layers, 160 routed experts and 2
shared a layer, about 236 B parameters) and `moe-30b` (Qwen3-MoE-shaped, 48
layers of 128 experts).
"""
import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CONFIGS = {
    "7b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=4096,
               intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
    "moe-30b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                    num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                    head_dim=128),
    "moe-100b": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400,
                     hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160,
                     n_shared_experts=2, num_experts_per_tok=6, num_hidden_layers=60, first_k_dense_replace=1,
                     num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                     qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, topk_method="greedy", n_group=1,
                     topk_group=1),
}


def checkpoint(cfg):
    """The checkpoint's tensor names, shapes and dtypes, from transformers'
    model of the config on the meta device and its own conversion rules."""
    import torch
    import transformers
    from wsync.checkpoint import checkpoint_tensors
    cfg = dict(cfg, max_position_embeddings=4096)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {n: (tuple(t.shape), torch.bfloat16) for n, t in checkpoint_tensors(model).tensors.items()}, config


def vllm_model(path):
    """vLLM's model of the config at `path`, built on the meta device."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    cfg = EngineArgs(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
                     enforce_eager=True, load_format="dummy").create_engine_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
        with torch.device("meta"):
            return initialize_model(vllm_config=cfg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--configs", default="7b,moe-30b,moe-100b")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.abspath(args.build), "python"))
    from vllm_env import prepare_cpu
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    prepare_cpu()
    from wsync.vllm.loader import derive_layout
    for name in args.configs.split(","):
        shapes, config = checkpoint(CONFIGS[name])
        tmp = tempfile.mkdtemp(prefix="wsync_bench_layout_")
        c = config.to_dict()
        c["torch_dtype"] = c["dtype"] = "bfloat16"
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(c, f)
        model = vllm_model(tmp)
        params = sum(p.numel() for p in model.parameters())
        times = []
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(args.repeat):
            t = time.perf_counter()
            layout = derive_layout(model, shapes)
            times.append(time.perf_counter() - t)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        pieces = sum(len(rt.pieces) for rt in layout.tensors)
        print(f"{name}: {params / 1e9:.1f} B parameters, {len(shapes)} checkpoint tensors -> {len(layout.tensors)} "
              f"runtime tensors, {pieces} pieces, {len(layout.derived)} derived layers: "
              f"derive_layout median {statistics.median(times):.2f} s (of {args.repeat}), peak memory grew "
              f"{grown / 1024:.0f} MiB", flush=True)
        del model
        import vllm.distributed.parallel_state as ps
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    return 0


if __name__ == "__main__":
    sys.exit(main())
