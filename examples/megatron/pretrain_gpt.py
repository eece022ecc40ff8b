"""Pretrain a GPT on megatron-core with tensor, pipeline and data parallelism, the way
Megatron-LM's ``pretrain_gpt.py`` does, with Megatron-LM's flag names:

    torchrun --nproc-per-node 4 -m examples.megatron.pretrain_gpt \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 \\
        --train-iters 20 --lr 1e-3 --mock-data --vocab-size 128 \\
        --save ckpt --save-interval 5 [--load ckpt] [--use-distributed-optimizer]

It runs on GPUs (NCCL) and on CPUs (gloo), where it enables :mod:`ftmem_megatron.cpu.core`.
The data is synthetic and a pure function of (seed, global sample index), so a
resumed run sees exactly the batches an uninterrupted one does; training is
deterministic, and resuming from a ``--ckpt-format torch`` checkpoint
(``examples/megatron/torch_checkpoint.py``) continues bitwise like an uninterrupted run.

In-memory checkpoints: ``--non-persistent-ckpt-type in_memory
--non-persistent-save-interval N`` with the ``--ftmem-*`` flags, dispatched as
Megatron-LM with the patch in ``patches/`` dispatches them (a persistent save takes
precedence at an iteration that has both; ``--load`` restores from memory when memory
holds a newer iteration than the disk). ``--out PATH`` writes per-iteration losses and
per-rank SHA-256 digests of the final parameters and optimizer state, and
``--stop-after N`` waits, once iteration N's snapshot is protected, to be killed
(both for tests).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import struct
import sys
import time
from datetime import timedelta
from functools import partial
from typing import Iterator

import numpy as np
import torch

from examples.process_end import end_process
from ftmem_megatron.cpu import core as cpu_core
from ftmem_megatron.arguments import (IN_MEMORY, add_ftmem_args, add_non_persistent_args, in_memory,
                                      validate_ftmem_args)

SUPPORTED_CKPT_FORMATS = ("torch",)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.megatron.pretrain_gpt")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, required=True)
    g.add_argument("--vocab-size", type=int, required=True, help="the mock data's vocabulary (no tokenizer)")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate output layer (default: tied to the word embeddings, as in Megatron-LM)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--mock-data", action="store_true", help="synthetic data (the only data this driver has)")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and compute, fp32 main parameters and gradient reduction (as Megatron-LM's "
                        "--bf16)")
    g = p.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root"),
                   default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory of persistent checkpoints")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None, help="resume from the latest checkpoint in this directory")
    g.add_argument("--ckpt-format", default="torch")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration, not the latest")
    g.add_argument("--finetune", action="store_true",
                   help="load the model alone (no optimizer, scheduler or RNG state) and start at iteration 0")
    g.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer and scheduler state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the RNG state")
    add_non_persistent_args(p)
    add_ftmem_args(p)
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--out", default=None,
                   help="(tests) write per-iteration losses and per-rank digests of the final state as JSON")
    g.add_argument("--loss-log", default=None,
                   help="(tests) append each iteration's loss as a JSON line once it is computed, across restarts "
                        "(a killed run's losses included, which --out, written at the end, does not have)")
    g.add_argument("--stop-after", type=int, default=None,
                   help="(tests) once iteration N's in-memory snapshot is protected, wait to be killed")
    g.add_argument("--end-at-exit", action="store_true",
                   help="(tests) end as Megatron-LM's pretrain() does: no checkpointing.finish call, ftmem's end "
                        "runs at exit")
    args = p.parse_args(argv)
    if args.ckpt_format not in SUPPORTED_CKPT_FORMATS:
        p.error(f"--ckpt-format {args.ckpt_format} is not supported; this driver writes only "
                f"{', '.join(SUPPORTED_CKPT_FORMATS)} (Megatron-LM's --ckpt-format torch layout)")
    if not args.mock_data:
        p.error("only --mock-data is supported (the driver has no dataset pipeline)")
    if args.save and not args.save_interval:
        p.error("--save needs --save-interval")
    if args.non_persistent_ckpt_type not in (None, IN_MEMORY):
        p.error(f"--non-persistent-ckpt-type {args.non_persistent_ckpt_type} is not supported by this driver; "
                f"it implements {IN_MEMORY} (through ftmem)")
    if args.bf16 and not torch.cuda.is_available():
        p.error("--bf16 needs CUDA: megatron-core's mixed-precision optimizer wraps CUDA tensors only; "
                "run in fp32 (without --bf16) on the CPU")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    return args


# ---------------------------------------------------------------- initialization

def initialize(args) -> None:
    """torch.distributed, megatron-core's parallel groups, and every RNG."""
    from megatron.core import parallel_state, tensor_parallel

    if not torch.cuda.is_available():
        cpu_core.enable()
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group(backend=backend,
                                         timeout=timedelta(minutes=args.distributed_timeout_minutes))
    args.rank, args.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % model_parallel:
        raise SystemExit(f"world size {args.world_size} is not a multiple of TP x PP = {model_parallel}")
    args.data_parallel_size = args.world_size // model_parallel
    batch_per_iteration = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % batch_per_iteration:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                         f"micro batch x DP = {batch_per_iteration}")
    args.num_microbatches = args.global_batch_size // batch_per_iteration
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes)
    # As Megatron-LM's _set_random_seed: each pipeline stage its own seed; the
    # tensor-parallel stream is offset by the TP rank inside model_parallel_cuda_manual_seed.
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cpu = not torch.cuda.is_available()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16,
        use_cpu_initialization=on_cpu,
        # The batched p2p path calls torch.cuda.synchronize() after each exchange.
        batch_p2p_comm=not on_cpu)


def build_model(args, config) -> list:
    """This rank's GPT stage wrapped in megatron-core's DDP (a one-chunk list, as
    megatron-core's schedules and Megatron-LM's checkpointing expect)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=args.vocab_size, max_sequence_length=args.max_position_embeddings,
                   share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                   pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage())
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    if args.bf16:
        # As Megatron-LM's get_model: the wrapper casts the first stage's input to bf16 and
        # the last stage's output back to fp32.
        gpt = Float16Module(config, gpt)
    # As Megatron-LM with --bf16: gradients accumulate and reduce in fp32.
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=args.use_distributed_optimizer,
                                               grad_reduce_in_fp32=args.bf16)
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)]


def build_optimizer(args, model, config):
    """megatron-core's Adam (the DistributedOptimizer with --use-distributed-optimizer),
    its learning-rate scheduler counted in samples as Megatron-LM's is, and the
    schedule hooks Megatron-LM's training.setup_model_and_optimizer installs."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                        clip_grad=args.clip_grad, bf16=args.bf16,
                        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                        use_distributed_optimizer=args.use_distributed_optimizer),
        model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.lr_decay_iters * args.global_batch_size, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size, wd_incr_style="constant")
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return optimizer, scheduler


# ---------------------------------------------------------------- data

def mock_sample(seed: int, global_index: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """Sample ``global_index`` of the run: ``seq_length + 1`` tokens, a pure function of
    (seed, index). An arithmetic progression modulo the vocabulary with a random start
    and stride, so that the loss has something to learn."""
    rng = np.random.default_rng([seed, global_index])
    start, stride = rng.integers(vocab_size), rng.integers(1, 8)
    return torch.from_numpy((start + stride * np.arange(seq_length + 1)) % vocab_size)


def microbatches(args, iteration: int) -> Iterator[dict]:
    """This DP rank's micro-batches of ``iteration`` (0-based), laid out as
    Megatron-LM's MegatronPretrainingSampler lays them out: each group of
    micro_batch x DP consecutive samples is split across the DP ranks."""
    from megatron.core import parallel_state

    dp_rank, mbs = parallel_state.get_data_parallel_rank(), args.micro_batch_size
    first = iteration * args.global_batch_size
    positions = torch.arange(args.seq_length).unsqueeze(0).expand(mbs, -1)
    for micro in range(args.num_microbatches):
        base = first + micro * mbs * args.data_parallel_size + dp_rank * mbs
        samples = torch.stack([mock_sample(args.seed, base + i, args.seq_length, args.vocab_size)
                               for i in range(mbs)])
        yield {"tokens": samples[:, :-1].contiguous(), "labels": samples[:, 1:].contiguous(),
               "loss_mask": torch.ones(mbs, args.seq_length), "position_ids": positions}


def to_device(batch: dict) -> dict:
    if not torch.cuda.is_available():
        return batch
    return {k: v.cuda(non_blocking=True) for k, v in batch.items()}


# ---------------------------------------------------------------- one iteration

def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's GPT loss: summed over unmasked tokens, with the token count, so
    that the schedule averages per token and the log reduces across DP exactly."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    batch = to_device(next(data_iterator))
    # attention_mask None: the layers use the causal mask of their attn_mask_type.
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def train_step(args, iteration, model, optimizer, opt_param_scheduler):
    """Iteration ``iteration`` (1-based): forward/backward over every micro-batch with
    megatron-core's pipeline schedule, the optimizer step, the scheduler step.
    Returns the DP-averaged lm loss (on the last pipeline stage; None elsewhere) and
    the grad norm."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=microbatches(args, iteration - 1), model=model,
        num_microbatches=args.num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False)
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        opt_param_scheduler.step(increment=args.global_batch_size)
    if not parallel_state.is_pipeline_last_stage():
        return None, grad_norm
    summed = torch.vstack([m["lm loss"] for m in losses]).sum(dim=0)
    torch.distributed.all_reduce(summed, group=parallel_state.get_data_parallel_group())
    return summed[0] / summed[1], grad_norm


def floating_point_operations(args) -> float:
    """Model FLOPs of one iteration (Narayanan et al. 2021, eq. 3 without recomputation)."""
    b, s, layers, h, v = args.global_batch_size, args.seq_length, args.num_layers, args.hidden_size, args.vocab_size
    return 72.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers))


# ---------------------------------------------------------------- the loop

def is_loss_reporter() -> bool:
    """The rank that holds the reduced loss: last pipeline stage, DP rank 0, TP rank 0."""
    from megatron.core import parallel_state

    return (parallel_state.is_pipeline_last_stage() and parallel_state.get_data_parallel_rank() == 0
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def log_iteration(args, iteration, loss, grad_norm, lr, elapsed_s) -> None:
    print(f" iteration {iteration:8d}/{args.train_iters:8d} |"
          f" consumed samples: {iteration * args.global_batch_size:12d} |"
          f" elapsed time per iteration (ms): {elapsed_s * 1000:.1f} |"
          f" learning rate: {lr:.6E} | global batch size: {args.global_batch_size:5d} |"
          f" lm loss: {loss:.6E} | grad norm: {grad_norm:.3f} |", flush=True)


def train(args, model, optimizer, opt_param_scheduler, iteration, flops_so_far) -> dict:
    """Run iterations ``iteration + 1 .. train_iters``; returns {iteration: loss} of
    this rank (empty unless it is the loss reporter)."""
    from ftmem_megatron import checkpointing

    for chunk in model:
        chunk.train()
    losses = {}
    while iteration < args.train_iters:
        started = time.monotonic()
        loss, grad_norm = train_step(args, iteration + 1, model, optimizer, opt_param_scheduler)
        iteration += 1
        flops_so_far += floating_point_operations(args)
        if is_loss_reporter():
            losses[iteration] = loss
            if args.loss_log:
                with open(args.loss_log, "a") as f:
                    f.write(json.dumps({"it": iteration, "hex": float32_hex(loss)}) + "\n")
            if iteration % args.log_interval == 0:
                log_iteration(args, iteration, loss.item(), grad_norm, optimizer.param_groups[0]["lr"],
                              time.monotonic() - started)
        # As Megatron-LM's checkpoint_and_decide_exit: a persistent save takes precedence.
        if args.save and iteration % args.save_interval == 0:
            save_persistent(iteration, model, optimizer, opt_param_scheduler, flops_so_far, args)
        elif in_memory(args) and iteration % args.non_persistent_save_interval == 0:
            checkpointing.save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops_so_far, args)
        if iteration == args.stop_after:
            checkpointing.wait_flushed()
            print(f"rank {args.rank}: stopped after iteration {iteration}; waiting to be killed", flush=True)
            while True:
                time.sleep(60)
    if args.save and iteration % args.save_interval != 0:  # as Megatron-LM: the final state is saved too
        save_persistent(iteration, model, optimizer, opt_param_scheduler, flops_so_far, args)
    checkpointing.wait_flushed()
    return losses


def save_persistent(iteration, model, optimizer, opt_param_scheduler, flops_so_far, args) -> None:
    """Megatron's persistent save: from memory in the background where ftmem writes it
    (see :mod:`ftmem_megatron.format`), else synchronously to ``--save``."""
    from ftmem_megatron import checkpointing
    from ftmem_megatron.format import flushes_from_memory
    from examples.megatron.torch_checkpoint import save_checkpoint

    if flushes_from_memory(args):
        checkpointing.save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops_so_far, args,
                                      persistent=True)
    else:
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops_so_far, args)


# ---------------------------------------------------------------- --out (tests)

def float32_hex(value: torch.Tensor) -> str:
    return struct.pack(">f", value.item()).hex()


def state_digest(model, optimizer) -> str:
    """SHA-256 over this rank's parameters and optimizer state (tensors in a fixed
    order), for bitwise comparisons of runs."""
    digest = hashlib.sha256()

    def add(name: str, tensor: torch.Tensor) -> None:
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    for chunk in model:
        for name, param in sorted(chunk.module.named_parameters()):
            add(name, param)
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            for key, value in sorted(inner_state(optimizer).get(param, {}).items()):
                if isinstance(value, torch.Tensor):
                    add(f"{group_index}.{param_index}.{key}", value)
    return digest.hexdigest()


def inner_state(optimizer) -> dict:
    """The torch optimizer's per-parameter state behind a megatron-core optimizer
    (merged across a ChainedOptimizer's parts)."""
    state = {}
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        state.update(part.optimizer.state)
    return state


def write_out(args, losses: dict, model, optimizer) -> None:
    digests = [None] * args.world_size
    torch.distributed.all_gather_object(digests, state_digest(model, optimizer))
    if not is_loss_reporter():
        return
    result = {"losses": {str(i): {"float": loss.item(), "hex": float32_hex(loss)} for i, loss in losses.items()},
              "digests": digests}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, args.out)


# ---------------------------------------------------------------- main

def main(argv=None) -> None:
    from megatron.core import parallel_state

    from ftmem_megatron import checkpointing
    from examples.megatron.torch_checkpoint import load_checkpoint

    args = parse_args(argv)
    initialize(args)
    validate_ftmem_args(args)
    config = transformer_config(args)
    model = build_model(args, config)
    optimizer, opt_param_scheduler = build_optimizer(args, model, config)
    iteration, flops_so_far = 0, 0.0
    if args.load:
        loaded = checkpointing.load_checkpoint(model, optimizer, opt_param_scheduler, args) if in_memory(args) else None
        if loaded is None:
            loaded = load_checkpoint(model, optimizer, opt_param_scheduler, args)
            checkpointing.report_disk_load(loaded[0], args)
        iteration, flops_so_far = loaded
    if args.rank == 0:
        print(f"pretrain_gpt: world {args.world_size} = TP {args.tensor_model_parallel_size} x "
              f"PP {args.pipeline_model_parallel_size} x DP {args.data_parallel_size}, "
              f"{args.num_microbatches} micro-batches per iteration, optimizer {type(optimizer).__name__}, "
              f"{'bf16' if args.bf16 else 'fp32'} parameters, "
              f"starting at iteration {iteration}, on "
              f"{'CUDA' if torch.cuda.is_available() else 'the CPU (its CPU support enabled)'}", flush=True)
    losses = train(args, model, optimizer, opt_param_scheduler, iteration, flops_so_far)
    if args.out:
        write_out(args, losses, model, optimizer)
    torch.distributed.barrier()
    if args.end_at_exit:
        return
    checkpointing.finish(args)  # before the process groups go: the ranks agree on freeing memory
    parallel_state.destroy_model_parallel()
    end_process()


if __name__ == "__main__":
    main(sys.argv[1:])
