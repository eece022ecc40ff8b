"""A DeepSpeed training script as a user writes it: nothing in it knows the checkpoint
engine, which only the JSON config names (tests/integration/deepspeed/test_deepspeed.py::test_the_json_alone_switches_ftmem_on_in_a_script_that_never_mentions_it).

    python -m tests.harness.stock_deepspeed_train --config CONFIG.json --save-dir DIR --iters N --out DIR
        [--save-16bit DIR] [--also-save-to DIR]
        [--read-back zero_to_fp32|zero_to_fp32-on-rank-0|torch-load|torch-load-all|torch-load-in-worker|
                     torch-load-weights-only|ds_to_universal-on-rank-0]
        [--read-back-tag TAG] [--reload] [--client-args] [--load-tag TAG] [--load-without-optimizer-states]

Each step's loss (as float hex) and the final weights go to ``--out``; it saves after
every step and, when ``--save-dir`` holds a checkpoint, resumes from it. At the end,
``--save-16bit`` exports the model with ``engine.save_16bit_model``,
``--also-save-to`` saves the last step's checkpoint once more into another directory, and
``--read-back`` reads the newest checkpoint's files as scripts do, writing what it got
to ``--out``: DeepSpeed's zero_to_fp32 in-process (on every rank, or on rank 0 only),
or ``torch.load`` of the rank's model-states file by path (its module, or every tensor
in it), in the rank itself or in a forked worker process (as DeepSpeed's ds_to_universal
reads files), or with torch.load's default ``weights_only``; or DeepSpeed's universal-checkpoint
conversion on rank 0 alone, in-process, as DeepSpeed's own tests run it (into ``<tag>_universal``
beside the checkpoint). A ``{rank}`` in ``--config`` is the rank's number (``RANK``): a rank
may run with its own config. ``--client-args`` saves the
script's args (an ``argparse.Namespace``, as many scripts do) in the client state. ``--read-back-tag`` reads that tag's files instead of the newest's.
``--load-tag`` resumes from that tag instead of the newest checkpoint (a universal one, with
``"load_universal"`` in the config); ``--load-without-optimizer-states`` loads it with
``load_optimizer_states=False``.
``--reload`` takes one more step past the newest checkpoint and loads it again mid-run,
without the optimizer's states and then with them (:func:`reload`).
"""
import argparse
import concurrent.futures
import json
import multiprocessing
import os
from types import SimpleNamespace

import torch

import deepspeed.ops

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a JIT-built op training does not use
import deepspeed  # noqa: E402

from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO  # noqa: E402

from examples.process_end import end_process  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--save-16bit", default=None)
    p.add_argument("--also-save-to", default=None)
    p.add_argument("--read-back", default=None,
                   choices=("zero_to_fp32", "zero_to_fp32-on-rank-0", "torch-load", "torch-load-all",
                            "torch-load-in-worker", "torch-load-weights-only", "ds_to_universal-on-rank-0"))
    p.add_argument("--read-back-tag", default=None)
    p.add_argument("--reload", action="store_true")
    p.add_argument("--client-args", action="store_true")
    p.add_argument("--load-tag", default=None)
    p.add_argument("--load-without-optimizer-states", action="store_true")
    args = p.parse_args()
    with open(args.config.format(rank=os.environ["RANK"])) as f:
        config = json.load(f)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 16))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = torch.distributed.get_rank()
    print(f"rank {rank}: checkpoint engine {type(engine.checkpoint_engine).__name__}", flush=True)
    torch.manual_seed(99 + rank)  # per-rank dropout masks

    path, client_state = engine.load_checkpoint(args.save_dir, tag=args.load_tag,
                                                load_optimizer_states=not args.load_without_optimizer_states)
    start = client_state["next_step"] if path else 0
    with open(os.path.join(args.out, f"rank{rank}.losses.jsonl"), "a") as losses:
        for step in range(start, args.iters):
            data = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(4, 16, generator=data), torch.randn(4, 16, generator=data)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.write(json.dumps({"it": step, "loss": loss.item().hex()}) + "\n")
            losses.flush()
            client_state = {"next_step": step + 1, **({"args": args} if args.client_args else {})}
            if args.read_back == "ds_to_universal-on-rank-0":
                client_state[UNIVERSAL_CHECKPOINT_INFO] = {}  # the conversion needs it, as DeepSpeed's tests save it
            engine.save_checkpoint(args.save_dir, client_state=client_state)
    torch.save({k: v.detach().clone() for k, v in engine.module.state_dict().items()},
               os.path.join(args.out, f"rank{rank}.final.pt"))
    if args.reload:
        for optimizer_states in (False, True):
            reload(engine, args.save_dir, optimizer_states, args.out)
    if args.save_16bit:
        print(f"rank {rank}: save_16bit_model returned {engine.save_16bit_model(args.save_16bit)}", flush=True)
    if args.also_save_to:
        engine.save_checkpoint(args.also_save_to, client_state={"next_step": args.iters})
    if args.read_back:
        read_back(args.read_back, engine, args.save_dir, args.read_back_tag,
                  os.path.join(args.out, f"rank{rank}.read-back.pt"))
    engine.destroy()
    end_process()


def reload(engine, save_dir: str, optimizer_states: bool, out: str) -> None:
    """One more step past the newest checkpoint (the optimizer's state moves on), then
    ``load_checkpoint(save_dir, load_optimizer_states=...)`` again. What the ZeRO optimizer
    holds after it goes to ``out``; the log says how many of its tensors are still the
    objects it held before the load."""
    rank = torch.distributed.get_rank()
    data = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 16, generator=data), torch.randn(4, 16, generator=data)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    before = optimizer_tensors(engine)
    engine.load_checkpoint(save_dir, load_optimizer_states=optimizer_states)
    after = optimizer_tensors(engine)
    kept = sum(after[k] is before.get(k) for k in after)
    name = "with" if optimizer_states else "without"
    torch.save({k: v.detach().clone() for k, v in after.items()},
               os.path.join(out, f"rank{rank}.reload-{name}-optimizer-states.pt"))
    print(f"rank {rank}: reloaded {name} optimizer states; {kept} of {len(after)} optimizer tensors kept in place",
          flush=True)


def optimizer_tensors(engine) -> dict:
    """The ZeRO-1/2 optimizer's fp32 partitions and its torch optimizer's state, by name."""
    zero = engine.optimizer
    found = {f"fp32.{i}": t for i, t in enumerate(zero.single_partition_of_fp32_groups)}
    for index, state in zero.optimizer.state_dict()["state"].items():
        found.update({f"state.{index}.{key}": value for key, value in state.items() if torch.is_tensor(value)})
    return found


def read_back(how: str, engine, save_dir: str, tag, out: str) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    rank = torch.distributed.get_rank()
    if how.startswith("torch-load"):
        if tag is None:
            with open(os.path.join(save_dir, "latest")) as f:
                tag = f.read().strip()
        path = engine._get_ckpt_name(save_dir, tag)
        if how == "torch-load-in-worker":
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
                print(f"rank {rank}: worker read {pool.submit(describe_read, path).result()}", flush=True)
            return
        if how == "torch-load-weights-only":
            try:
                got = torch.load(path, map_location="cpu")["module"]  # torch's default: weights_only=True
            except Exception as e:
                said = " ".join(str(e).split())  # torch's message spans lines
                print(f"rank {rank}: torch.load refused: {said}", flush=True)
                return
        else:
            got = torch.load(path, map_location="cpu", weights_only=False)
            got = dict(tensors_in(got)) if how == "torch-load-all" else got["module"]
    elif how == "ds_to_universal-on-rank-0":
        if tag is None:
            with open(os.path.join(save_dir, "latest")) as f:
                tag = f.read().strip()
        if rank == 0:
            from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal

            convert_to_universal(SimpleNamespace(
                input_folder=os.path.join(save_dir, tag), output_folder=os.path.join(save_dir, f"{tag}_universal"),
                num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                inject_missing_state=False))
            print(f"rank {rank}: converted {tag} to a universal checkpoint", flush=True)
        torch.distributed.barrier()
        return
    elif how == "zero_to_fp32" or rank == 0:
        got = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    else:
        return
    torch.save({k: v.clone() for k, v in got.items()}, out)
    print(f"rank {rank}: read back {len(got)} tensors with {how}", flush=True)


def tensors_in(obj, name: str = ""):
    """(dotted name, tensor) for every tensor in a loaded checkpoint file."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from tensors_in(value, f"{name}.{key}" if name else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from tensors_in(value, f"{name}.{i}" if name else str(i))


def describe_read(path: str) -> str:
    """In a worker process: what ``torch.load`` of ``path`` gave, as text (a worker's result is pickled)."""
    try:
        return f"{len(torch.load(path, map_location='cpu', weights_only=False)['module'])} tensors"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    main()
