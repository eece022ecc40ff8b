"""Run megatron-core 0.16.1 on a machine without CUDA (CPU tensors, gloo).

megatron-core assumes a GPU in a handful of ways that have nothing to do with the
model's arithmetic: it allocates buffers on ``torch.cuda.current_device()`` or on the
literal device ``"cuda"``, keeps its model-parallel RNG streams as CUDA generator
states, and the DistributedOptimizer checks that parameters are ``torch.cuda.*Tensor``.
:func:`enable` redirects exactly those to the CPU. Importing this module changes
nothing: a CPU run calls :func:`enable` before it builds anything with megatron-core
(the example driver ``examples.megatron.pretrain_gpt`` does when CUDA is absent).
:func:`enable` does nothing where CUDA is available, so the same driver runs unchanged
on GPUs.

Besides these patches the driver sets ``batch_p2p_comm=False`` on CPU: the batched
pipeline send/recv path calls ``torch.cuda.synchronize()`` after every exchange.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

from ftmem.adapter import CPU_SUPPORT, require_for

_enabled = False


def enable() -> None:
    """Install the CPU patches (once per process: idempotent); a no-op when CUDA is available."""
    global _enabled
    if _enabled or torch.cuda.is_available():
        return
    require_for(CPU_SUPPORT, "megatron-core")
    _answer_current_device_with_cpu()
    _redirect_cuda_device_arguments()
    _use_cpu_rng_tracker()
    _name_cpu_tensor_types_as_cuda()
    _load_distributed_optimizer_state_into_torch_adam()
    _enabled = True


def _answer_current_device_with_cpu() -> None:
    # Replaces torch.cuda.current_device(), which raises without CUDA. megatron-core
    # passes it as the device of ~20 allocations: GlobalMemoryBuffer (the TP
    # all-gather/reduce-scatter scratch), DDP's param/grad buffers, pipeline p2p
    # receive buffers, the DistributedOptimizer's gather buffers. "cpu" puts them all
    # on the host.
    torch.cuda.current_device = lambda: "cpu"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites a ``device="cuda"`` argument of any torch call to the CPU, and makes
    ``tensor.cuda()`` return the (CPU) tensor itself."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _redirect_cuda_device_arguments() -> None:
    # Replaces the literal device "cuda" in megatron-core's small allocations, which
    # cannot be patched one by one without copying whole functions: the default causal
    # attention mask (transformer.utils.get_default_causal_mask), the token counters
    # of the pipeline schedules, the optimizer's found_inf/scale tensors, and the
    # grad-norm tensors of clip_grads / local_multi_tensor_l2_norm; and the
    # ``weight.data.cuda()`` with which LanguageModule ties the word embeddings of the
    # first and last pipeline stages. The mode is entered
    # for the rest of the process (it is per thread; megatron-core's CPU work all runs
    # on the training thread, autograd's CPU backward included).
    _CudaToCpu().__enter__()


def _use_cpu_rng_tracker() -> None:
    # Replaces the class megatron-core instantiates as its model-parallel RNG tracker
    # (tensor_parallel.random.CudaRNGStatesTracker, looked up by name in
    # initialize_rng_tracker). The original stores CUDA generator states; on the CPU
    # the named streams (data-parallel, tensor-model-parallel, expert) are states of
    # the CPU default generator, swapped in and out by fork(). Subclassing keeps
    # get_states/set_states/reset and megatron-core's isinstance checks.
    from megatron.core.tensor_parallel import random as mp_random

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            outside = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            # The original also warns when the CPU state changes inside fork(); here
            # the forked stream *is* the CPU generator, so that check does not apply.
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            # megatron-core 0.16 names the stream in use (its own fork sets the name); 0.15 and before do not.
            outside, outside_name = torch.get_rng_state(), getattr(self, "_current_state_name", None)
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outside)
                self._current_state_name = outside_name

    mp_random.CudaRNGStatesTracker = CpuRNGStatesTracker


def _name_cpu_tensor_types_as_cuda() -> None:
    # megatron-core's optimizers sort and check tensors by their type name and accept
    # only torch.cuda.{Float,Half,BFloat16}Tensor: clip_grad_by_total_norm_fp32 asserts
    # every grad is a torch.cuda.FloatTensor, and the DistributedOptimizer's
    # _build_model_and_main_param_groups raises TypeError on anything else. Within
    # just these two functions, a CPU tensor's type() answers with its CUDA name.
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    mcore_optimizer.clip_grad_by_total_norm_fp32 = within(_CpuTypeAsCuda, mcore_optimizer.clip_grad_by_total_norm_fp32)
    build_groups = DistributedOptimizer._build_model_and_main_param_groups.__func__
    DistributedOptimizer._build_model_and_main_param_groups = classmethod(within(_CpuTypeAsCuda, build_groups))


def within(context, fn):
    """``fn``, each call of it run inside a new ``context()``."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)
    return wrapper


class _CpuTypeAsCuda(TorchFunctionMode):
    """``tensor.type()`` answers ``torch.cuda.FloatTensor`` for a CPU float tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and result.startswith("torch."):
            result = result.replace("torch.", "torch.cuda.", 1)
        return result


def _load_distributed_optimizer_state_into_torch_adam() -> None:
    # Not a CUDA assumption but a megatron-core 0.16.1 bug on the path every CPU
    # machine takes: without Apex/TransformerEngine the optimizer is torch's AdamW,
    # which keeps a per-parameter "step" tensor. DistributedOptimizer.load_state_dict
    # puts one shared "step" into every parameter's state, and
    # _set_main_param_and_optimizer_states (loading distrib_optim.pt) then copies
    # *every* state key from the file, which holds param/exp_avg/exp_avg_sq only:
    # KeyError 'step'. The step is restored by load_state_dict; this skips it here.
    # And since AdamW increments each state's step in place (foreach), the one shared
    # tensor would advance once per parameter per iteration: each gets its own copy.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    load_state_dict = DistributedOptimizer.load_state_dict

    @functools.wraps(load_state_dict)
    def load_state_dict_with_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(set_states)
    def set_states_but_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            set_states(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer.load_state_dict = load_state_dict_with_own_steps
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_but_step
