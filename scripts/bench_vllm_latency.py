"""What an update costs a running generation: the time between consecutive
tokens of sequences a real vLLM AsyncLLM generates (this machine's CPU)
while wsync brings it to new versions.

A Llama-style model (about 150 M parameters by default) is trained for real
(AdamW, --lr) for as many steps as the runs need; each step's BF16 weights
are published through a wsync source while the engine generates, at the
same moments in every run (every --every tokens of the first sequence). The
engine (TP 1, eager, the `wsync` weight-transfer backend) generates
--requests greedy sequences of --tokens tokens each, streamed, three times:
  - none:  no version: the baseline;
  - keep:  each version then applied with pause_generation(mode="keep"),
           the update round trip, resume_generation(): the requests in
           flight wait and go on;
  - live:  each version applied with the update round trip alone, the
           generation running (vLLM runs it between two model steps).
Printed for each: p50 / p99 / max of the time between a sequence's
consecutive tokens, and the update round trip (median). Each version is
staged by the sink before its update starts. On this 2-core machine the
source's encode and the sink's staging share the cores with the engine
(beside a real trainer, only the sink's staging would): the figures of
keep and live are upper bounds of what an update adds.

    <vLLM python> scripts/bench_vllm_latency.py --build build [--updates 4 --every 40 --tokens 240]
"""
import argparse
import asyncio
import dataclasses
import os
import statistics
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

from bench_vllm import llama, model_arguments, system_with_sink  # noqa: E402
from vllm_env import prepare_cpu  # noqa: E402


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(ap)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=240)
    ap.add_argument("--every", type=int, default=40, help="tokens of the first sequence between versions")
    ap.add_argument("--updates", type=int, default=4, help="versions per run")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    prepare_cpu()

    import torch
    import vllm_test as T
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from wsync import Sink, Source
    from wsync.checkpoint import checkpoint_tensors
    from wsync.vllm import WsyncInitInfo, WsyncUpdateInfo

    tmp = tempfile.mkdtemp(prefix="wsync_bench_latency_")
    s = system_with_sink(args.build, tmp)
    try:
        model = llama(args, positions=args.tokens + 64)
        ckpt = os.path.join(tmp, "step-0")
        T.save_checkpoint(model, ckpt)
        initial = {n: t.detach().to(torch.bfloat16).clone() for n, t in checkpoint_tensors(model).tensors.items()}
        # The steps every run publishes, trained beforehand (the trainer is another machine's work).
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        gen = torch.Generator().manual_seed(2)
        steps = []
        for _ in range(2 * args.updates):
            batch = torch.randint(0, args.vocab, (2, 64), generator=gen)
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
            steps.append({n: t.detach().to(torch.bfloat16).clone()
                          for n, t in checkpoint_tensors(model).tensors.items()})
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters; "
              f"{len(steps)} steps trained at lr {args.lr:g}", flush=True)

        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=ckpt, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=args.tokens + 32, seed=0,
            max_num_seqs=args.requests, max_num_batched_tokens=args.tokens + 32, enforce_eager=True,
            weight_transfer_config={"backend": "wsync"}))
        sink = Sink(f"unix:{tmp}/sink-tp1-0.sock")
        source = Source(f"unix:{tmp}/source.sock")
        weights = initial

        async def update(version, pause):
            if pause:
                await engine.pause_generation(mode="keep", clear_cache=False)
            await engine.start_weight_update()
            await engine.update_weights(WeightTransferUpdateRequest(
                update_info=dataclasses.asdict(WsyncUpdateInfo(version=version, timeout=60.0))))
            await engine.finish_weight_update(str(version))
            if pause:
                await engine.resume_generation()

        async def staged(version):
            deadline = time.time() + 120
            while time.time() < deadline:
                st = sink.status()
                if st.staged_version == version or st.version >= version:
                    return
                await asyncio.sleep(0.005)
            raise SystemExit(f"the sink did not stage version {version} in 120 s")

        async def run(mode, first_step):
            sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
            gaps, rounds = [], []
            todo = asyncio.Queue()

            async def sequence(i):
                last, count = None, 0
                prompt = {"prompt_token_ids": T.PROMPTS[i % len(T.PROMPTS)]}
                async for out in engine.generate(prompt, sp, request_id=f"{mode}-{i}"):
                    now = time.perf_counter()
                    n = len(out.outputs[0].token_ids)
                    if last is not None and n:
                        gaps.append((now - last) / n)
                        gaps.extend([(now - last) / n] * (n - 1))
                    last = now
                    count += n
                    if (mode != "none" and i == 0 and count // args.every > (count - n) // args.every
                            and todo.qsize() < args.updates):
                        todo.put_nowait(count)

            async def versions():
                for k in range(args.updates if mode != "none" else 0):
                    await todo.get()
                    for n, t in steps[first_step + k].items():
                        weights[n].copy_(t)
                    stats = await asyncio.to_thread(source.publish)
                    await staged(stats.version)
                    t0 = time.perf_counter()
                    await update(stats.version, pause=(mode == "keep"))
                    rounds.append(time.perf_counter() - t0)

            updater = asyncio.create_task(versions())
            await asyncio.gather(*(sequence(i) for i in range(args.requests)))
            await updater
            return gaps, rounds

        async def bench():
            await engine.init_weight_transfer_engine(WeightTransferInitRequest(
                init_info=dataclasses.asdict(WsyncInitInfo(sink_address=f"unix:{tmp}/sink-tp{{tp_size}}-{{tp_rank}}.sock",
                                                           timeout=60.0))))
            source.register(weights, serve_offered=True)
            v1 = source.publish()
            await update(v1.version, pause=False)
            warm = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
            async for _ in engine.generate({"prompt_token_ids": T.PROMPTS[0]}, warm, request_id="warm"):
                pass
            results = {}
            for mode, first in (("none", 0), ("keep", 0), ("live", args.updates)):
                results[mode] = await run(mode, first)
            return results

        try:
            results = asyncio.run(bench())
        finally:
            source.close()
            engine.shutdown()
        base = None
        for mode, (gaps, rounds) in results.items():
            p50, p99, worst = (1e3 * percentile(gaps, 50), 1e3 * percentile(gaps, 99), 1e3 * max(gaps))
            base = base or (p50, p99)
            extra = (f"; update round trip {1e3 * statistics.median(rounds):.1f} ms (median of {len(rounds)})"
                     if rounds else "")
            print(f"{mode:>5}: inter-token p50 {p50:6.1f} ms, p99 {p99:6.1f} ms, max {worst:6.1f} ms "
                  f"over {len(gaps)} tokens (p99 {p99 - base[1]:+.1f} ms against none){extra}", flush=True)
    finally:
        s.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the checkpoint


if __name__ == "__main__":
    main()
