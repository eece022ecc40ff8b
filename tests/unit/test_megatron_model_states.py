"""The model entries of Megatron's torch-format checkpoint, kept from one save to the next
(ftmem_megatron.format.ModelStates): megatron-core's walk of every module runs once while only
values change, and again whenever what it gave no longer holds. Each save's entries are
compared with a fresh ``state_dict_for_save_checkpoint()`` of megatron-core's own module."""
import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from ftmem_megatron.format import ModelStates
from ftmem_megatron.sharded_state import to_snapshot

CONFIG = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)


class Scaled(torch.nn.Module):
    """A layer with an extra state that changes at every step (as Transformer Engine's FP8 scales)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4))
        self.steps = 0

    def get_extra_state(self):
        return {"steps": self.steps}

    def set_extra_state(self, state):
        self.steps = state["steps"]


class Model(MegatronModule):
    def __init__(self):
        super().__init__(CONFIG)
        self.linear = torch.nn.Linear(4, 4)
        self.scaled = Scaled()
        self.register_buffer("seen", torch.zeros(2))
        self.walks = 0
        self.doubled = False  # its checkpoint holds the linear layer's weight doubled (a new tensor)

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        self.walks += 1
        entries = super().state_dict_for_save_checkpoint(prefix, keep_vars)
        if self.doubled:
            entries["linear.weight"] = entries["linear.weight"] * 2
        return entries


def save(states: ModelStates, model: Model) -> dict:
    """One save's model entries, from the sharded state as megatron-core describes the model
    (each local tensor the module's own) and ftmem converts it."""
    sharded = {"model0": {key: ShardedTensor.from_rank_offsets(key, value)
                          for key, value in model.state_dict(keep_vars=True).items()
                          if isinstance(value, torch.Tensor)}}
    _, places, placed = to_snapshot(sharded)
    return states.of([model], places, placed)["model"]


def assert_current(entries: dict, model: Model) -> None:
    fresh = model.state_dict()
    assert entries.keys() == fresh.keys()
    for key, value in fresh.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(entries[key], value), key
        else:
            assert entries[key] == value, key


def step(model: Model) -> None:
    """What a training step changes: values, in place, and the extra state."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.add_(1)
    model.scaled.steps += 1


def test_while_only_values_change_the_walk_runs_once_and_each_save_holds_the_current_values():
    """Each tensor entry is then the sharded state's own tensor object (here the module's), which
    the snapshot's skeleton meets again, not a view of it to be found an alias."""
    model, states = Model(), ModelStates()
    for _ in range(3):
        entries = save(states, model)
        assert_current(entries, model)
        own = {key: value for key, value in model.state_dict(keep_vars=True).items() if isinstance(value, torch.Tensor)}
        assert all(entries[key] is value for key, value in own.items())
        step(model)
    assert model.walks == 1
    assert entries["scaled._extra_state"] == {"steps": 2}


def replace_parameter(model: Model) -> None:
    model.linear.weight = torch.nn.Parameter(torch.randn(4, 4))


def replace_data(model: Model) -> None:
    model.linear.weight.data = torch.randn(4, 4)  # the same Parameter, other memory


def add_parameter(model: Model) -> None:
    model.scaled.bias = torch.nn.Parameter(torch.randn(4))


def replace_buffer(model: Model) -> None:
    model.seen = torch.full((2,), 7.0)


def rename_module(model: Model) -> None:
    """The same tensors in the same order, under other keys."""
    model._modules = type(model._modules)(
        ("renamed" if name == "linear" else name, module) for name, module in model._modules.items())


@pytest.mark.parametrize("change", [replace_parameter, replace_data, add_parameter, replace_buffer,
                                    rename_module])
def test_after_a_change_of_more_than_values_the_walk_runs_again(change):
    model, states = Model(), ModelStates()
    save(states, model)
    step(model)
    change(model)
    assert_current(save(states, model), model)
    assert model.walks == 2
    step(model)
    assert_current(save(states, model), model)
    assert model.walks == 2  # kept again from the second walk


def test_a_model_whose_checkpoint_holds_new_tensors_is_walked_at_every_save():
    model, states = Model(), ModelStates()
    model.doubled = True  # (its sharded state holds the weight itself)
    for saves in range(1, 4):
        entries = save(states, model)
        assert torch.equal(entries["linear.weight"], model.linear.weight * 2)
        assert model.walks == saves
        step(model)
