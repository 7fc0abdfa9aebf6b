"""How long a real vLLM engine stops generating per version: wsync against
vLLM's own dense path, in one run on this machine's CPU.

A Llama-style model (about 150 M parameters by default) is trained for real
(AdamW, FP32 masters, RL-like learning rate 1e-5) by a trainer that publishes
each step through vLLM's trainer-side API with the `wsync` backend; two vLLM
engines (TP 1, torch.compile on, as vLLM runs by default) hold the weights:
  - wsync:  the `wsync` weight-transfer backend; its pause is the
            start_weight_update / update_weights / finish_weight_update
            round trip (the sink writes the changed values meanwhile: it
            pulled, checked, decoded and proved the version against the
            weights before, while the engine held them, and the bench
            starts the update once the sink says the version is staged);
  - dense:  vLLM's own dense path, `reload_weights` of the step's full
            tensors (read in the worker from the step's safetensors file,
            in the page cache): what RL frameworks call after shipping
            every tensor;
and after each step both must generate the same greedy tokens and logprobs.
Printed per version: the fraction of BF16 values that changed, the sink's
staging (off the pause) and its writes between the holds (as the sink
measured them), the engine's pause with each, and the bytes each moves
(what the sink pulled against the full BF16 tensors); then medians.

`--quantization fp8_per_channel`: both engines are FP8 engines (vLLM's
online per-channel FP8): wsync ships the codes and scales the trainer
quantizes (docs/fp8.md); the dense path reloads the BF16 tensors and
vLLM quantizes them again.

    <vLLM python> scripts/bench_vllm.py --build build [--hidden 1024 --layers 8 --steps 5 --lr 1e-5]
                                        [--quantization fp8_per_channel]
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

from vllm_env import prepare_cpu  # noqa: E402


def model_arguments(ap):
    """The build and the model's shape and learning rate (the vLLM benches share them)."""
    ap.add_argument("--build", default="build")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--lr", type=float, default=1e-5)


def llama(args, positions):
    """The Llama-style model of those arguments, in FP32, seeded."""
    import torch
    import transformers
    h = args.hidden
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=h, intermediate_size=h * 11 // 4,
                                      num_hidden_layers=args.layers, num_attention_heads=h // 64,
                                      num_key_value_heads=max(1, h // 256), max_position_embeddings=positions,
                                      tie_word_embeddings=False)
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(config).float()


def system_with_sink(build, tmp):
    """A coordinator, a source and the TP 1 engine's sink (sink-tp1-0) on loopback, under tmp."""
    from system_demo import System
    s = System(os.path.abspath(build), 0, 4, tmp)
    try:
        s.start_sink("sink-tp1-0")
        s.wait_for(lambda: os.path.exists(f"{tmp}/sink-tp1-0.sock"), "the sink's local API")
    except BaseException:
        s.stop()
        raise
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(ap)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile)")
    ap.add_argument("--quantization", default=None, help="both engines' quantization (fp8_per_channel)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    prepare_cpu()

    import torch
    import vllm_test as T
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from wsync import Sink
    from wsync.vllm import LLMClient, WsyncTrainerInitInfo

    tmp = tempfile.mkdtemp(prefix="wsync_bench_vllm_")
    s = system_with_sink(args.build, tmp)
    try:
        model = llama(args, positions=512)
        params = sum(p.numel() for p in model.parameters())
        ckpt = os.path.join(tmp, "step-0")
        loaded = T.save_checkpoint(model, ckpt)
        print(f"model: {params / 1e6:.0f} M parameters, {params * 2 / 1e6:.0f} MB in BF16; "
              f"{'eager' if args.eager else 'torch.compile'}; engines {args.quantization or 'BF16'}", flush=True)

        def engine(wsync):
            extra = {"weight_transfer_config": {"backend": "wsync"}} if wsync else {}
            if args.quantization:
                extra["quantization"] = args.quantization
            return LLM(model=ckpt, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, seed=0,
                       max_num_seqs=len(T.PROMPTS), max_num_batched_tokens=128, enforce_eager=args.eager, **extra)

        t = time.time()
        ws, dense = engine(True), engine(False)
        print(f"engines up in {time.time() - t:.0f} s", flush=True)
        trainer = WeightTransferTrainerFactory.trainer_init(
            WsyncTrainerInitInfo(rank=0, source_address=f"unix:{tmp}/source.sock",
                                 sink_address=f"unix:{tmp}/sink-tp{{tp_size}}-{{tp_rank}}.sock"),
            client=LLMClient(ws), source=ModuleSource(model))
        trainer.send_weights()  # version 1: the loaded weights (a keyframe)
        T.generate(ws), T.generate(dense)  # compiled graphs warm
        sink = Sink(f"unix:{tmp}/sink-tp1-0.sock")

        def staged(version):
            # The engine holds the weights between updates: the sink stages the version, then waits.
            deadline = time.time() + 120
            while time.time() < deadline:
                st = sink.status()
                if st.staged_version == version or st.version >= version:
                    return
                time.sleep(0.005)
            raise SystemExit(f"the sink did not stage version {version} in 120 s: {sink.status()}")

        def bits(tensors):
            return {k: v.view(torch.int16) if v.dtype == torch.bfloat16 else v for k, v in tensors.items()}
        prev = bits(loaded)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        gen = torch.Generator().manual_seed(2)
        rows = []
        try:
            for step in range(1, args.steps + 1):
                batch = torch.randint(0, args.vocab, (2, 64), generator=gen)
                model(input_ids=batch, labels=batch).loss.backward()
                opt.step()
                opt.zero_grad()
                path = os.path.join(tmp, f"step-{step}")
                tensors = T.save_checkpoint(model, path)
                dense_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
                now = bits(tensors)
                changed = sum(int((now[k] != prev[k]).sum()) for k in now) / sum(v.numel() for v in now.values())
                prev = now
                # wsync: the publish (encode) runs while the engine may generate; the pause is the update.
                received = sink.status().bytes_received
                stats = trainer.wsync.publish()
                staged(stats.version)
                t0 = time.perf_counter()
                trainer.client.start_weight_update()
                trainer.client.update_weights({"version": stats.version, "timeout": 60.0})
                trainer.client.finish_weight_update(str(stats.version))
                t1 = time.perf_counter()
                st = sink.status()
                pulled = st.bytes_received - received
                dense.collective_rpc("reload_weights", kwargs={"weights_path": path})
                dense.reset_prefix_cache()
                t2 = time.perf_counter()
                same = T.generate(ws) == T.generate(dense)
                rows.append((t1 - t0, t2 - t1, pulled, dense_bytes, changed, st.staging_ms, st.apply_ms))
                print(f"  version {stats.version}: {100 * changed:.2f}% changed | wsync pause {1e3 * (t1 - t0):6.1f} ms "
                      f"(sink: staged {st.staging_ms:.0f} ms before, wrote {st.apply_ms:.1f} ms in it), "
                      f"{pulled:>11,} bytes pulled | dense pause {1e3 * (t2 - t1):6.1f} ms, {dense_bytes:>11,} bytes "
                      f"| same tokens and logprobs: {same}", flush=True)
                if not same:
                    # Which of them differs from vLLM's own fresh load of the step (parameters, bit for bit)?
                    bad = {what: T.state_differs(llm, path) for what, llm in (("wsync", ws), ("dense", dense))}
                    raise SystemExit("the two engines disagree; parameters that differ from a fresh load of the step: "
                                     + "; ".join(f"{w}: {len(b)} {b[:3]}" for w, b in bad.items()))
        finally:
            trainer.shutdown()
            T.shutdown(ws)
            T.shutdown(dense)
            s.stop()
        w = statistics.median(r[0] for r in rows)
        d = statistics.median(r[1] for r in rows)
        pb = statistics.median(r[2] for r in rows)
        db = statistics.median(r[3] for r in rows)
        ch = statistics.median(r[4] for r in rows)
        stage = statistics.median(r[5] for r in rows)
        write = statistics.median(r[6] for r in rows)
        print(f"medians over {len(rows)} versions at lr {args.lr:g} ({100 * ch:.2f}% changed): pause {1e3 * w:.1f} ms "
              f"with wsync ({100 * w / d:.0f}% of dense; the sink's writes {write:.1f} ms, its staging {stage:.0f} ms "
              f"before), {1e3 * d:.0f} ms dense; bytes {pb:,.0f} with wsync, {db:,.0f} dense ({db / pb:.0f}x fewer)")
    finally:
        s.stop()  # also when an engine fails to start
        shutil.rmtree(tmp, ignore_errors=True)  # a checkpoint per step


if __name__ == "__main__":
    main()
