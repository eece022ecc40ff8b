"""Train the small GPT with DeepSpeed, checkpointing with whatever engine the JSON
config selects (ftmem with ``"checkpoint": {"engine": "ftmem"}``).

    torchrun --nproc-per-node 3 -m examples.deepspeed.train_gpt --deepspeed-config configs/zero1.json \\
        --save-dir ckpt --iters 20 [--load] [--out DIR] [--checkpoint-engine default]
    deepspeed --num_gpus 3 examples/deepspeed/train_gpt.py ...   (same flags)

``--checkpoint-engine default`` trains without ftmem: the config's ``"checkpoint"``
engine and ``"ftmem"`` section are dropped and ``ftmem_deepspeed`` is not imported,
so DeepSpeed's stock engine (``TorchCheckpointEngine``, torch.save) saves every step
(the tests' uninterrupted reference runs, which show that ftmem changes nothing in
training). It says which ftmem modules the process loaded: none with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, which also keeps ``ftmem_guard`` out.

A ``"pipeline": {"stages": S, "model_parallel": M}`` section trains it as a DeepSpeed
PipelineModule of S stages on a pipe x data x model grid, which becomes DeepSpeed's
mpu (the model axis replicates the layers: the GPT has no tensor-parallel layers, but
checkpoint files and groups are those of a model-parallel job). It saves with ``engine.save_checkpoint`` after every step (``--save-interval``)
and, with ``--load``, resumes with ``engine.load_checkpoint`` — the training script
does not know which engine serves them. ``--out`` gets per-rank losses and final
weights (for bitwise comparisons); ``--stop-after N`` waits, once step N's snapshot
is protected (and flushed, with ``"persist"``), to be killed (for the crash tests);
``--reload-after N`` loads the newest checkpoint again after step N's save, mid-run;
``--load --tag TAG`` loads the checkpoint of that tag, not the newest; ``--note-steps`` prints
a line between each step's backward and its optimizer step (for tests that hold a snapshot's
copy while the next step's forward runs)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

from examples.deepspeed.gpt import GPT, GPTConfig, Head, batch, layers, lm_loss
from examples.process_end import end_process


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m examples.deepspeed.train_gpt")
    p.add_argument("--deepspeed-config", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--save-interval", type=int, default=1)
    p.add_argument("--load", action="store_true", help="resume with engine.load_checkpoint(save_dir)")
    p.add_argument("--tag", default=None,
                   help="with --load: load_checkpoint(save_dir, TAG), the checkpoint of that tag, not the newest")
    p.add_argument("--no-optimizer-states", action="store_true",
                   help="with --load: load_checkpoint(save_dir, load_optimizer_states=False)")
    p.add_argument("--module-only", action="store_true",
                   help="with --load: load_checkpoint(save_dir, load_module_only=True)")
    p.add_argument("--out", default=None, help="write per-rank losses and final weights here")
    p.add_argument("--stop-after", type=int, default=None)
    p.add_argument("--reload-after", type=int, default=None,
                   help="after step N's save, load_checkpoint(save_dir) again, mid-run, and train on")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dropout", type=float, default=GPTConfig.dropout)
    p.add_argument("--batch-norm", action="store_true",
                   help="a BatchNorm before the head (running statistics that differ across DP replicas)")
    p.add_argument("--note-steps", action="store_true",
                   help="print 'rank R: step S backward done' between a step's backward and its optimizer step (for "
                        "tests that hold a snapshot's copy while the next step's forward runs)")
    p.add_argument("--ftmem", default=None, help='JSON merged into the config\'s "ftmem" section')
    p.add_argument("--checkpoint-engine", choices=("ftmem", "default"), default="ftmem",
                   help="ftmem (default): import ftmem_deepspeed and save with the engine the config selects; "
                        "default: DeepSpeed's stock engine, no ftmem (the config's \"checkpoint\" engine and "
                        "\"ftmem\" section dropped)")
    p.add_argument("--dist-backend", choices=("nccl", "gloo"), default=None,
                   help="torch.distributed backend (default: nccl with CUDA, gloo without); gloo lets several ranks "
                        "share one GPU")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = p.parse_args(argv)
    if args.checkpoint_engine == "default" and args.ftmem:
        p.error("--ftmem configures the ftmem engine; --checkpoint-engine default does not use it")
    return args


def load_config(args) -> dict:
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if args.checkpoint_engine == "default":
        config.pop("ftmem", None)
        checkpoint = config.get("checkpoint", {})
        checkpoint.pop("engine", None)
        if not checkpoint:
            config.pop("checkpoint", None)
    elif args.ftmem:
        config.setdefault("ftmem", {}).update(json.loads(args.ftmem))
    return config


def final_weights(engine, zero_stage: int) -> dict:
    """This rank's full parameters (gathered under ZeRO-3) and buffers, for bitwise comparisons."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    gathered = deepspeed.zero.GatheredParameters(list(params.values())) if zero_stage == 3 else contextlib.nullcontext()
    with gathered:
        weights = {k: v.detach().clone() for k, v in params.items()}
    return {**weights, **{k: v.clone() for k, v in engine.module.named_buffers()}}


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        # On CPU DeepSpeed JIT-compiles an inference-only shared-memory op (~90 s) at
        # init; training does not use it.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if args.checkpoint_engine == "ftmem":
        import ftmem_deepspeed  # noqa: F401  (installs the "engine": "ftmem" selection)
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    config = load_config(args)
    cfg = GPTConfig(hidden=args.hidden, layers=args.layers, seq_len=args.seq_len, dropout=args.dropout,
                    batch_norm=args.batch_norm)
    deepspeed.init_distributed(dist_backend=args.dist_backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    pipeline = config.get("pipeline") or {}
    stages, model_parallel = pipeline.get("stages", 1), pipeline.get("model_parallel", 1)
    if stages > 1 or model_parallel > 1:
        # A DeepSpeed PipelineModule whose grid is the job's mpu (pipe x data x model axes).
        world = torch.distributed.get_world_size()
        topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=model_parallel,
                                                 num_dp=world // (stages * model_parallel))
        model = PipelineModule(layers=layers(cfg)[:-1] + [Head(cfg)], topology=topology, loss_fn=lm_loss,
                               partition_method="uniform")
    else:
        model = GPT(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    zero_stage = engine.zero_optimization_stage()
    rank = torch.distributed.get_rank()
    print(f"rank {rank}: ZeRO stage {zero_stage}, optimizer {type(engine.optimizer).__name__}, "
          f"checkpoint engine {type(engine.checkpoint_engine).__name__}, device {engine.device}, "
          f"backend {torch.distributed.get_backend()}", flush=True)
    if args.checkpoint_engine == "default":
        loaded = sorted(m for m in sys.modules if m.split(".")[0].startswith("ftmem"))
        print(f"rank {rank}: ftmem modules loaded: {', '.join(loaded) or 'none'}", flush=True)
    piped = stages > 1 or model_parallel > 1
    replica = engine.mpu.get_data_parallel_rank() if piped else torch.distributed.get_rank(engine.data_parallel_group)
    torch.manual_seed(99 + rank)  # per-rank dropout masks

    start = 0
    if args.load:
        path, client_state = engine.load_checkpoint(args.save_dir, args.tag, load_optimizer_states=not args.no_optimizer_states,
                                                    load_module_only=args.module_only)
        if path:
            start = client_state["next_step"]
            print(f"rank {rank}: resuming at step {start} (client_state), global step {engine.global_steps}",
                  flush=True)
    losses = open(os.path.join(args.out, f"rank{rank}.losses.jsonl"), "a") if args.out else None
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(start, args.iters):
        if piped:
            micro_batches = iter([batch(cfg, step * 100 + i, replica, micro)
                                  for i in range(engine.gradient_accumulation_steps())])
            loss = engine.train_batch(micro_batches)
        else:
            x, y = (t.to(engine.device) for t in batch(cfg, step, replica, micro))
            loss = engine(x, y)
            engine.backward(loss)
            if args.note_steps:
                print(f"rank {rank}: step {step} backward done", flush=True)
            engine.step()
        if losses:
            losses.write(json.dumps({"it": step, "loss": loss.item()}) + "\n")
            losses.flush()
        if (step + 1) % args.save_interval == 0:
            engine.save_checkpoint(args.save_dir, client_state={"next_step": step + 1})
        if step == args.reload_after:
            path, client_state = engine.load_checkpoint(args.save_dir)
            print(f"rank {rank}: reloaded {os.path.basename(os.path.dirname(path))} after step {step}, next step "
                  f"{client_state['next_step']}", flush=True)
        if step == args.stop_after:
            if args.checkpoint_engine == "ftmem":
                engine.checkpoint_engine.wait_flushed()  # the stock engine's save is done when it returns
            print(f"rank {rank}: stopped after step {step}; waiting to be killed", flush=True)
            while True:
                time.sleep(3600)
    if args.out:
        torch.save(final_weights(engine, zero_stage), os.path.join(args.out, f"rank{rank}.final.pt"))
    engine.destroy()
    end_process()


if __name__ == "__main__":
    main()
