"""Megatron-LM's ``--ckpt-format torch`` layout on disk, for the persistent tier
(``--save``, ``--save-interval`` written from memory) and ``ftmem export``, and
Megatron's RNG (the model-parallel tracker beside the process-wide generators).

With ``--non-persistent-ckpt-type in_memory`` and ``--ckpt-format torch``, a persistent
save becomes an in-memory snapshot that the persistent tier (:mod:`ftmem._disk.persist`)
writes to ``--save`` in the background, once protected: the training loop pays for the
copy only, as for any snapshot. The files are the ones Megatron-LM's own torch-format
save writes — ``iter_XXXXXXX/mp_rank_XX[_YYY]/model_optim_rng.pt``, written by DP rank 0
of each (TP, PP) position, then ``latest_checkpointed_iteration.txt`` — so Megatron-LM
loads them without ftmem.

The snapshot carries what those files hold in Megatron's own form: the model's
``state_dict_for_save_checkpoint()`` and ``optimizer.state_dict()``. Their tensors are
the ones the sharded state already holds, which a snapshot stores once
(:mod:`ftmem._state.serialize`), so the second form costs nothing but its structure.

The distributed optimizer's ``distrib_optim.pt`` is the parameter state gathered over
DP; a snapshot holds each rank's own shard only, so with ``--use-distributed-optimizer``
(and with any other ``--ckpt-format``) Megatron writes its persistent checkpoints
itself, as without ftmem.

``ftmem export`` writes the same layout from shared memory (:meth:`MegatronFormat.write_group`).
"""
from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from ftmem import FtmemError
from ftmem.adapter import FrameworkFormat, elements, save_atomically

from .arguments import in_memory
from .sharded_state import Place
from .torch_checkpoint import (MODEL_FILENAME, checkpoint_content, iteration_dir, model_keys, model_state,
                               own_rng_state, rank_dir_name, rng_state, set_rng_state, write_tracker)

# Places ride in every snapshot's skeleton, which ftmem loads only with admitted types (the
# list torch.load(weights_only=True) uses): admitted wherever this format is loaded, the
# training job and `ftmem export` alike. A Place holds strings and tuples only.
torch.serialization.add_safe_globals([Place])


def flushes_from_memory(args) -> bool:
    """Whether ftmem writes this job's persistent checkpoints (see the module doc)."""
    return (in_memory(args) and bool(getattr(args, "save", None)) and getattr(args, "ckpt_format", None) == "torch"
            and not getattr(args, "use_distributed_optimizer", False))


class TorchFormat:
    """The parts of ``model_optim_rng.pt`` a snapshot carries beside its sharded state, at
    each save (:meth:`view`)."""

    def __init__(self) -> None:
        self._model_states = ModelStates()

    def view(self, model: list, optimizer, args, persistent: bool, model_places: dict, placed: dict) -> Optional[dict]:
        """Model and optimizer state dicts (aliases of the snapshot's tensors), the args and
        this rank's directory name; ``model_places`` and ``placed`` as :meth:`ModelStates.of`
        takes them. A persistent save adds the DP ranks' RNG states, which the writer stores
        (a collective over DP, as in Megatron-LM's save). None with the distributed optimizer
        (see the module doc)."""
        if getattr(args, "use_distributed_optimizer", False):
            return None
        content = {"model": self._model_states.of(model, model_places, placed),
                   "optimizer": optimizer.state_dict() if optimizer is not None else None,
                   "args": args, "rank_dir": rank_dir_name()}
        if persistent:
            content["rng_state"] = rng_state(args)
        return content


class ModelStates:
    """The model entries of ``model_optim_rng.pt`` (:func:`~ftmem_megatron.torch_checkpoint.model_state`)
    at each save, kept from one save to the next.

    megatron-core walks every module for them (``state_dict_for_save_checkpoint``): about
    8 ms of each save call at 80 layers on the project's CPU machine, the largest part of
    ftmem's share. What the walk gives is detached views of the parameters and buffers, which
    training updates in place, so one save's result holds at the next as long as nothing but
    values changed. That is checked at every save, and the walk runs again where it fails:
    the places of the model's sharded state are the last walk's (no tensor added, removed or
    reshaped), its tensors view the same elements as then, each of the kept tensors among them
    (a parameter replaced, or a state-dict hook that makes new tensors, fails it), and each
    value that is not a tensor is a module's ``_extra_state``, which is asked for again (it may
    change at every step, as Transformer Engine's FP8 scales do).

    Each kept tensor is replaced, at every save, by the sharded state's tensor that views the
    same elements: the snapshot's skeleton then meets one object twice, which pickling answers
    from its memo, instead of thousands of views it must find to be aliases (about 5 ms of
    each save call at 80 layers)."""

    def __init__(self) -> None:
        self._kept: Optional[_KeptModelState] = None

    def of(self, model: list, model_places: dict, placed: dict) -> dict:
        """``model_state(model)``. ``model_places`` are the places of the model's sharded state
        by path, ``placed`` the sharded state's tensors by path
        (:func:`~ftmem_megatron.sharded_state.to_snapshot`)."""
        held = elements([placed[path] for path in model_places])
        kept = self._kept
        if kept is None or kept.places != model_places or kept.held != held:
            entries = model_state(model)
            kept = self._kept = _kept(model, entries, model_places, held)
            if kept is None:
                return entries
        for entries, key, module in kept.extra_states:
            entries[key] = module.get_extra_state()
        for entries, key, path in kept.tensors:
            entries[key] = placed[path]
        return kept.entries


class _KeptModelState(NamedTuple):
    places: dict  # the places of the model's sharded state at the walk
    held: list  # what its tensors viewed then (ftmem.adapter.elements)
    entries: dict  # model_state(model)'s result, each tensor among those
    extra_states: list  # (entries of a chunk, key, module) of each _extra_state, asked again at each save
    tensors: list  # (entries of a chunk, key, path) of each tensor: the sharded state's at path, put in at each save


def _kept(model: list, entries: dict, places: dict, held: list) -> Optional[_KeptModelState]:
    """``entries`` (``model_state(model)``), kept where each tensor views one of the elements
    ``held`` (those of the tensors at ``places``' paths, in order) and each other value is a
    module's ``_extra_state``; else None."""
    found, found_at, extra_states = [], [], []
    for name, chunk in zip(model_keys(len(model)), model):
        for key, value in entries[name].items():
            if isinstance(value, torch.Tensor):
                found.append(value)
                found_at.append((entries[name], key))
                continue
            module = _extra_state_owner(chunk, key)
            if module is None:
                return None
            extra_states.append((entries[name], key, module))
    path_of = dict(zip(held, places))
    paths = [path_of.get(viewed) for viewed in elements(found)]
    if None in paths:
        return None
    return _KeptModelState(places, held, entries, extra_states,
                           [(chunk_entries, key, path) for (chunk_entries, key), path in zip(found_at, paths)])


def _extra_state_owner(chunk: torch.nn.Module, key: str) -> Optional[torch.nn.Module]:
    """The module whose ``get_extra_state()`` the state dict holds at ``key``; None where the
    key is no module's extra state."""
    if key != _EXTRA_STATE and not key.endswith("." + _EXTRA_STATE):
        return None
    try:
        module = chunk.get_submodule(key[:-len(_EXTRA_STATE)].rstrip("."))
    except AttributeError:
        return None
    return module if type(module).get_extra_state is not torch.nn.Module.get_extra_state else None


_EXTRA_STATE = "_extra_state"  # torch's key, after a module's prefix, for what get_extra_state() gives


def write_model_optim_rng(state: Any, directory: str, wrote: Callable[[str], None]) -> None:
    """Write a snapshot's ``model_optim_rng.pt`` under the iteration directory ``directory``.
    ``state["torch_format"]`` must hold ``rng_state`` (:func:`~ftmem_megatron.torch_checkpoint.rng_state`)."""
    carried = state["torch_format"]
    model_entries = {name: {key: value.detach() if isinstance(value, torch.Tensor) else value
                            for key, value in entries.items()}
                     for name, entries in carried["model"].items()}  # as state_dict() gives them: no Parameters
    content = checkpoint_content(carried["args"], state["iteration"], model_entries, carried["optimizer"],
                                 state["scheduler"], carried["rng_state"],
                                 state["num_floating_point_operations_so_far"])
    path = os.path.join(directory, carried["rank_dir"], MODEL_FILENAME)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_atomically(content, path)
    wrote(path)


class MegatronFormat(FrameworkFormat):
    """Megatron-LM's ``--ckpt-format torch`` layout: DP rank 0 of each (TP, PP) position
    writes its ``model_optim_rng.pt``; the other replicas only agree."""

    name = "megatron"

    def capture_rng(self) -> dict:
        return own_rng_state()

    def restore_rng(self, states: dict) -> None:
        set_rng_state(states)

    def checkpoint_name(self, version: int, state: Any) -> str:
        return os.path.basename(iteration_dir("", state["iteration"]))

    def write_rank(self, state: Any, directory: str, rank: int, first_replica: bool, wrote) -> None:
        if not first_replica:
            return
        carried = state["torch_format"]
        if "rng_state" not in carried:  # an in-memory save, flushed at a preemption: this rank's RNG is the entry
            if getattr(carried["args"], "data_parallel_random_init", False):
                raise FtmemError(
                    f"version {state['iteration']} is an in-memory save of a job with --data-parallel-random-init, "
                    f"whose checkpoint holds every DP rank's RNG states; only Megatron's persistent saves gather "
                    f"them. It stays in memory; `ftmem export` writes it from there.")
            carried["rng_state"] = [state["rng"]]
        write_model_optim_rng(state, directory, wrote)

    def write_group(self, group: Sequence[int], read_state: Callable[[int], Any], directory: str, wrote) -> str:
        """DP rank 0's file; with ``--data-parallel-random-init`` holding every DP rank's RNG
        states, which the others lend (:func:`~ftmem_megatron.torch_checkpoint.rng_state`)."""
        writer = read_state(group[0])
        if writer["torch_format"] is None:
            raise FtmemError(
                f"version {writer['iteration']} was saved with --use-distributed-optimizer, whose persistent "
                f"checkpoint (distrib_optim.pt) gathers the optimizer state over DP; ftmem cannot write it from "
                f"memory. Let the job save with Megatron's --save instead.")
        spread = getattr(writer["torch_format"]["args"], "data_parallel_random_init", False)
        writer["torch_format"]["rng_state"] = [writer["rng"]] + ([read_state(rank)["rng"] for rank in group[1:]]
                                                                 if spread else [])
        write_model_optim_rng(writer, directory, wrote)
        return self.checkpoint_name(writer["iteration"], writer)

    def publish(self, root: str, name: str) -> None:
        """Point Megatron at ``<root>/<name>``: ``latest_checkpointed_iteration.txt``."""
        write_tracker(root, int(name.removeprefix("iter_")))
