import itertools

import numpy as np
import pyeclib.ec_iface
import pytest

from ftmem._ec.codec import CHUNK, Codec
from ftmem.errors import FtmemError

rng = np.random.default_rng(7)
LENGTH = 2 * CHUNK + 77  # more than one kernel call, and a ragged tail


def pieces(count, length=LENGTH):
    return [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(count)]


def test_m1_is_plain_xor():
    data, parity = pieces(3), [np.empty(LENGTH, np.uint8)]
    Codec(3, 1).encode(data, parity)
    assert np.array_equal(parity[0], data[0] ^ data[1] ^ data[2])


@pytest.mark.parametrize("k, m", [(2, 2), (4, 2), (3, 3)])
def test_rs_parity_is_pyeclib_isa_l_rs_cauchy(k, m):
    data, parity = pieces(k), [np.empty(LENGTH, np.uint8) for _ in range(m)]
    codec = Codec(k, m)
    codec.encode(data, parity)
    fragments = pyeclib.ec_iface.ECDriver(k=k, m=m, ec_type="isa_l_rs_cauchy").encode(np.concatenate(data).tobytes())
    header = len(fragments[0]) - LENGTH
    for q in range(m):
        assert np.array_equal(np.frombuffer(fragments[k + q], np.uint8, LENGTH, header), parity[q])
        alone = np.empty(LENGTH, np.uint8)
        codec.encode_row(q, data, alone)
        assert np.array_equal(alone, parity[q])


@pytest.mark.parametrize("k, m", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_any_m_lost_pieces_are_rebuilt(k, m):
    codec = Codec(k, m)
    data, parity = pieces(k, 4096 + 3), [np.empty(4096 + 3, np.uint8) for _ in range(m)]
    codec.encode(data, parity)
    everything = dict(enumerate(data + parity))
    for lost_set in itertools.combinations(range(k + m), m):
        lost_data = [i for i in lost_set if i < k]
        available = {i: p for i, p in everything.items() if i not in lost_set}
        out = {i: np.zeros(4096 + 3, np.uint8) for i in lost_data}
        if out:
            codec.rebuild(available, out)
        assert all(np.array_equal(out[i], data[i]) for i in lost_data)


def test_too_few_pieces_is_an_error():
    codec = Codec(2, 1)
    data, parity = pieces(2, 64), [np.empty(64, np.uint8)]
    codec.encode(data, parity)
    with pytest.raises(FtmemError, match="needs 2 intact pieces, only 1"):
        codec.rebuild({2: parity[0]}, {0: np.empty(64, np.uint8), 1: np.empty(64, np.uint8)})
