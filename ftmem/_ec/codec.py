"""Erasure codes over equal-length pieces: k data pieces -> m parity pieces, and any k
of the k+m pieces rebuild the others.

Both codes run on ISA-L's table-driven GF(2^8) kernels, loaded from the copy that
pyeclib's wheel bundles (``pyeclib.libs/libisal-*.so``), called through ctypes:
ctypes releases the GIL, and the pieces are read and written in place (no per-call
copies or fragment headers, which is what makes pyeclib's own ``encode`` slow on
large buffers). Work is fed in chunks that stay in cache (see docs/design/erasure-coding.md).

* m = 1: plain XOR (the parity row is all ones).
* m >= 2: Reed-Solomon with ISA-L's Cauchy matrix, the same code as pyeclib's
  ``isa_l_rs_cauchy`` backend (the tests check the parity bytes match).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from functools import lru_cache
from typing import Mapping, Sequence

import numpy as np

from ftmem.errors import FtmemError

CHUNK = 256 << 10  # bytes per piece per kernel call: k+m chunks of this stay in L2

_u8p = ctypes.POINTER(ctypes.c_ubyte)


def _isal_candidates():
    """Paths of ISA-L to try: pyeclib's bundled copy, then the system's. Lazily: the
    system's lookup (``ctypes.util.find_library`` runs ``ldconfig``, a process) would
    slow every restarted rank's start, and is needed only where pyeclib's copy is missing
    or does not load."""
    try:
        import pyeclib

        libs = os.path.join(os.path.dirname(os.path.dirname(pyeclib.__file__)), "pyeclib.libs")
        yield from sorted(glob.glob(os.path.join(libs, "libisal*.so*")))
    except ImportError:
        pass
    system = ctypes.util.find_library("isal")
    if system:
        yield system


@lru_cache(maxsize=1)
def _isal() -> ctypes.CDLL:
    for path in _isal_candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        lib.ec_encode_data.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, _u8p,
                                       ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        lib.ec_init_tables.argtypes = [ctypes.c_int, ctypes.c_int, _u8p, _u8p]
        lib.gf_gen_cauchy1_matrix.argtypes = [_u8p, ctypes.c_int, ctypes.c_int]
        lib.gf_invert_matrix.argtypes = [_u8p, _u8p, ctypes.c_int]
        lib.gf_invert_matrix.restype = ctypes.c_int
        lib.gf_mul.argtypes = [ctypes.c_ubyte, ctypes.c_ubyte]
        lib.gf_mul.restype = ctypes.c_ubyte
        return lib
    raise FtmemError(
        "ftmem's erasure coding needs ISA-L, which the pyeclib wheel bundles: pip install 'pyeclib>=1.6' "
        "(or install libisal2 from your distribution)."
    )


def _ptr(a: np.ndarray) -> _u8p:
    return a.ctypes.data_as(_u8p)


def _addresses(pieces: Sequence[np.ndarray]) -> np.ndarray:
    return np.array([p.ctypes.data for p in pieces], dtype=np.uint64)


class Codec:
    """A systematic (k+m, k) code. Pieces are 1-D uint8 numpy arrays of one length."""

    def __init__(self, k: int, m: int):
        if k < 1 or m < 1:
            raise FtmemError(f"a code needs k >= 1 and m >= 1, got k={k}, m={m}.")
        self.k, self.m = k, m
        lib = _isal()
        matrix = np.zeros((k + m, k), dtype=np.uint8)
        if m == 1:
            matrix[:k] = np.eye(k, dtype=np.uint8)
            matrix[k] = 1  # XOR
        else:
            lib.gf_gen_cauchy1_matrix(_ptr(matrix), k + m, k)
        self.matrix = matrix
        self._encode_tables = self._tables(matrix[k:])
        self._row_tables = [self._tables(matrix[k + q : k + q + 1]) for q in range(m)]

    def _tables(self, rows: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(rows)
        tables = np.zeros(self.k * rows.shape[0] * 32, dtype=np.uint8)
        _isal().ec_init_tables(self.k, rows.shape[0], _ptr(rows), _ptr(tables))
        return tables

    def _run(self, tables: np.ndarray, rows: int, sources: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> None:
        length = len(sources[0])
        if any(len(p) != length for p in (*sources, *outputs)):
            raise FtmemError("erasure-code pieces must all have the same length")
        src, dst = _addresses(sources), _addresses(outputs)
        lib, tbl = _isal(), _ptr(tables)
        for start in range(0, length, CHUNK):
            n = min(CHUNK, length - start)
            src_ptrs = (ctypes.c_void_p * len(sources))(*(src + start).tolist())
            dst_ptrs = (ctypes.c_void_p * len(outputs))(*(dst + start).tolist())
            lib.ec_encode_data(n, self.k, rows, tbl, src_ptrs, dst_ptrs)

    def copies(self, q: int) -> bool:
        """Whether parity piece ``q`` is a copy of the one data piece (k = 1 with coefficient
        1, as under m = 1): a holder may then receive it straight into place, encoding nothing."""
        return self.k == 1 and int(self.matrix[1 + q, 0]) == 1

    def encode(self, data: Sequence[np.ndarray], parity: Sequence[np.ndarray]) -> None:
        """Write the m parity pieces of k data pieces into ``parity``."""
        if len(data) != self.k or len(parity) != self.m:
            raise FtmemError(f"encode takes {self.k} data and {self.m} parity pieces")
        self._run(self._encode_tables, self.m, data, parity)

    def encode_row(self, q: int, data: Sequence[np.ndarray], out: np.ndarray) -> None:
        """Write parity piece ``q`` alone: each parity holder computes only its own."""
        if len(data) != self.k:
            raise FtmemError(f"encode takes {self.k} data pieces")
        self._run(self._row_tables[q], 1, data, [out])

    def rebuild(self, available: Mapping[int, np.ndarray], lost: Mapping[int, np.ndarray]) -> None:
        """Rebuild lost data pieces in place.

        ``available`` maps piece indices (0..k-1 data, k..k+m-1 parity) to intact
        pieces, at least k of them; ``lost`` maps the data indices to rebuild to the
        buffers that receive them.
        """
        if len(available) < self.k:
            raise FtmemError(f"rebuilding needs {self.k} intact pieces, only {len(available)} are left")
        if any(i >= self.k for i in lost):
            raise FtmemError("only data pieces are rebuilt; parity is recomputed by the next save")
        use = sorted(available)[: self.k]
        chosen = np.ascontiguousarray(self.matrix[use])
        inverse = np.zeros_like(chosen)
        if _isal().gf_invert_matrix(_ptr(chosen), _ptr(inverse), self.k) != 0:
            raise FtmemError(f"pieces {use} do not determine the data (singular decode matrix)")
        wanted = sorted(lost)
        self._run(self._tables(inverse[wanted]), len(wanted), [available[i] for i in use],
                  [lost[i] for i in wanted])
