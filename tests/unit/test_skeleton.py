"""What a save call refuses to snapshot, whichever of its paths finds it: the tensors met in a
state are checked all at once after the pickling, and a tensor that is not a dense, strided,
plain one is named in an UnsupportedTensor, beside plain tensors that pass."""
import warnings

import pytest
import torch

from ftmem import UnsupportedTensor
from ftmem._state.serialize import split_state


def _not_dense():
    warnings.simplefilter("ignore")  # torch's notes that sparse CSR, nested and quantized tensors are beta or deprecated
    cases = {
        "sparse COO": torch.zeros(3).to_sparse(),
        "sparse CSR": torch.zeros(3, 3).to_sparse_csr(),
        "nested": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
        "jagged nested": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged),
        "meta": torch.zeros(3, device="meta"),
        "quantized": torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8),
    }
    if torch.backends.mkldnn.is_available():
        cases["mkldnn"] = torch.zeros(3).to_mkldnn()
    return cases


@pytest.mark.parametrize("name", list(_not_dense()))
def test_a_tensor_that_is_not_dense_and_strided_is_refused_among_plain_ones(name):
    odd = _not_dense()[name]
    with pytest.raises(UnsupportedTensor, match="dense strided|plain tensors"):
        split_state({"before": torch.ones(4), name: [odd], "after": torch.nn.Parameter(torch.ones(2))})


def test_empty_tensors_are_each_kept_and_plain_ones_pass():
    state = {"a": torch.empty(0), "b": torch.empty(0), "w": torch.ones(3), "view": torch.ones(6)[2:]}
    split = split_state(state)
    assert [t.shape for t in split.tensors] == [(0,), (0,), (3,), (4,)]
