"""Erasure-coded protection of committed versions across nodes, and rebuilding lost
ranks' data from it.

The unit of coding is an EC *column*: the ranks with the same local rank on the
nodes of one EC group. Its members sit on different nodes, so losing a node costs a
column at most one member, and a node's data is protected exactly when each of its
ranks' data is. Inside a column the stripe layout of :mod:`ftmem._ec.placement` applies:
member i's data is cut into k pieces of ``piece_size`` bytes; piece p belongs to
stripe (i - p) mod n, whose m parity pieces live on members s+k..s+n-1 (mod n).

Everything here is collective over the column's own gloo group (kept apart from the
training groups) and runs on the engine's background thread: gloo and the ISA-L
kernels release the GIL, so the training thread keeps running.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from ftmem._common import testhooks
from ftmem._common.collective import (NETWORK_FLOOR_BYTES_PER_S, Arrivals, collective_timeout_s, gather_bytes,
                                      new_group, posted_within)
from ftmem._state.checksum import checksum
from ftmem._ec.codec import Codec
from ftmem.errors import CorruptShard, EcGeometryMismatch, NotRecoverableFromMemory
from ftmem._state.plan import ALIGN
from ftmem._ec.placement import ECGroup
from ftmem._shm.slots import CommitRecord, ParityRecord, decode_record, encode_record

# What a parity holder receives per round when protecting (its m*k moves share it; two
# rounds are in flight at once, each with buffers of its own).
EXCHANGE_ROUND = 64 << 20


@dataclass(frozen=True)
class Topology:
    """Where every rank sits: node, EC group, position in the group, column."""

    world_size: int
    ranks_per_node: int
    groups: tuple[ECGroup, ...]

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def group_index(self, rank: int) -> int:
        node = self.node_of(rank)
        return next(i for i, g in enumerate(self.groups) if node in g.nodes)

    def position(self, rank: int) -> int:
        return self.groups[self.group_index(rank)].nodes.index(self.node_of(rank))

    def column_of(self, rank: int) -> tuple[int, int]:
        """The column ``rank`` codes in: its EC group's index and its local rank on its node."""
        return self.group_index(rank), rank % self.ranks_per_node

    def column_ranks(self, group_index: int, local_rank: int) -> list[int]:
        return [node * self.ranks_per_node + local_rank for node in self.groups[group_index].nodes]

    def columns(self) -> list[tuple[int, int]]:
        return [(g, local) for g in range(len(self.groups)) for local in range(self.ranks_per_node)]


def piece_size(lengths: list[int], k: int) -> int:
    return max(ALIGN, math.ceil(max(lengths) / k / ALIGN) * ALIGN)


def stripe_sources(group: ECGroup, stripe: int, has_data: set[int], has_parity: set[int]) -> Optional[list[tuple[int, int]]]:
    """k (position, code index) pairs that can rebuild ``stripe``, or None if fewer survive.

    Code indices 0..k-1 are the stripe's data pieces, k..k+m-1 its parity pieces.
    """
    available = [(pos, p) for p, pos in enumerate(group.data_members(stripe)) if pos in has_data]
    available += [(pos, group.k + q) for q, pos in enumerate(group.parity_members(stripe)) if pos in has_parity]
    return sorted(available, key=lambda a: a[1])[: group.k] if len(available) >= group.k else None


@dataclass(frozen=True)
class Geometry:
    """How a column's parity was encoded. Parity decodes only under the geometry it was
    encoded with: other k, m, members, piece size or member lengths give garbage."""

    k: int
    m: int
    nodes: tuple[int, ...]
    piece_size: int
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, record: ParityRecord) -> "Geometry":
        return cls(record.k, record.m, record.nodes, record.piece_size, record.lengths)

    def fits(self, group: ECGroup, held_lengths: dict[int, int]) -> bool:
        """Whether this parity can rebuild ``group`` now, whose members at the positions
        of ``held_lengths`` hold data of those lengths."""
        return ((self.k, self.m, self.nodes) == (group.k, group.m, group.nodes)
                and self.piece_size == piece_size(list(self.lengths), group.k)
                and all(self.lengths[pos] == n for pos, n in held_lengths.items()))

    def __str__(self) -> str:
        return (f"k={self.k}, m={self.m} over nodes {list(self.nodes)} (pieces of {self.piece_size} bytes, "
                f"members' data {list(self.lengths)} bytes)")


def geometry_problem(group: ECGroup, held_lengths: dict[int, int], recorded: list[Geometry]) -> Optional[str]:
    """Why the parity held (``recorded``, one per holder) cannot rebuild ``group``'s lost
    members as the job runs now, or None if it can."""
    wrong = next((g for g in recorded if not g.fits(group, held_lengths)), None)
    if wrong is None:
        return None
    lengths = ", ".join(str(held_lengths.get(pos, "lost")) for pos in range(group.n))
    return (f"the parity of EC group of nodes {list(group.nodes)} was written for {wrong}, but the job now runs "
            f"k={group.k}, m={group.m} over nodes {list(group.nodes)} (members' data [{lengths}] bytes); parity "
            f"rebuilds only under the geometry it was written with, so restart with that \"ec\" k and m and node "
            f"layout")


def column_problem(group: ECGroup, has_data: set[int], has_parity: set[int]) -> Optional[str]:
    """Why the members lacking data cannot be rebuilt, or None if they can."""
    lost = [pos for pos in range(group.n) if pos not in has_data]
    for pos in lost:
        for p in range(group.k):
            if stripe_sources(group, group.stripe_of_piece(pos, p), has_data, has_parity) is None:
                return (f"EC group of nodes {list(group.nodes)} (k={group.k}, m={group.m}) lacks node(s) "
                        f"{[group.nodes[i] for i in lost]} and holds intact parity on "
                        f"{[group.nodes[i] for i in sorted(has_parity)] or 'no node'}")
    return None


def plan_recovery(topology: Topology, data: list[dict[int, int]], parity: list[dict[int, Geometry]],
                  requested: Optional[int] = None,
                  needed: Optional[set[int]] = None) -> Optional[tuple[int, list[int]]]:
    """The newest version every needed rank can restore, held or rebuilt, and the ranks lost from it.

    ``data[r]``: the versions rank r holds intact, with their lengths in bytes;
    ``parity[r]``: the versions it holds intact parity for, with its geometry;
    ``needed``: the ranks that must restore (None: every rank), where another world adopts
    the version (:mod:`ftmem._engine.elastic`): a column that lost none of them need not rebuild. Every
    rank decides alike from the same inputs, before any rebuild moves a byte. Returns
    None when no rank holds any version (a fresh job); raises NotRecoverableFromMemory,
    naming the groups and nodes, when versions exist but none is recoverable everywhere
    (too many losses), and EcGeometryMismatch (a LayoutMismatch) when the newest needs
    parity written under another geometry than the job's now.
    """
    candidates = [requested] if requested is not None else sorted(set().union(*data), reverse=True)
    if not candidates:
        return None
    newest_problem, newest_geometry = None, False
    for version in candidates:
        problems, rebuild, geometry = [], [], False
        for g, local in topology.columns():
            ranks = topology.column_ranks(g, local)
            group = topology.groups[g]
            has_data = {pos for pos, r in enumerate(ranks) if version in data[r]}
            has_parity = {pos for pos, r in enumerate(ranks) if version in parity[r]}
            lost_needed = any(pos not in has_data and (needed is None or r in needed) for pos, r in enumerate(ranks))
            if lost_needed:
                wrong = geometry_problem(group, {pos: data[ranks[pos]][version] for pos in has_data},
                                         [parity[ranks[pos]][version] for pos in sorted(has_parity)])
                geometry = geometry or wrong is not None
                problem = wrong or column_problem(group, has_data, has_parity)
                if problem:
                    problems.append(problem)
            rebuild += [r for pos, r in enumerate(ranks) if pos not in has_data]
        if not problems:
            return version, sorted(rebuild)
        if newest_problem is None:
            newest_problem = f"version {version}: " + "; ".join(sorted(set(problems)))
            newest_geometry = geometry
    # Parity of another geometry is the job's configuration changed, not a loss: refused
    # as a layout change is (the disk only where allowed), with memory left as it is.
    error, advice = ((EcGeometryMismatch, "Restart with the EC geometry it was written with") if newest_geometry
                     else (NotRecoverableFromMemory, "Fall back to a disk checkpoint"))
    raise error(
        "no version is recoverable from memory (more losses than parity in a group, parity missing, or parity "
        f"written under another EC geometry). Newest held: {newest_problem}. {advice}."
    )


class ColumnCoder:
    """One rank's part in protecting and rebuilding its column's versions."""

    def __init__(self, topology: Topology, rank: int):
        gi = topology.group_index(rank)
        self.group = topology.groups[gi]
        self.position = topology.position(rank)
        self.codec = Codec(self.group.k, self.group.m)
        self.pg = None  # set by make_groups: creation is collective over the whole job
        self.arrivals: Optional[Arrivals] = None  # the column's, set with pg: its protection's waits are bounded
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, nbytes: int) -> torch.Tensor:
        """Reused staging buffers: no allocation per save once sizes settle."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def parity_nbytes(self, piece: int) -> int:
        return self.group.m * piece

    @staticmethod
    def _put_piece(dst: np.ndarray, data: np.ndarray, length: int, start: int, width: int) -> None:
        """Copy data bytes [start, start+width) into ``dst``, zeros past the data's ``length``."""
        chunk = data[start : min(start + width, length)] if start < length else data[:0]
        dst[: len(chunk)] = chunk
        dst[len(chunk) :] = 0

    # -- protect ------------------------------------------------------------------
    def exchange_info(self, record: CommitRecord) -> tuple[list[int], list[CommitRecord], int]:
        # Records travel as their plain encoding (ftmem._shm.slots), never as pickled objects.
        infos = gather_bytes(encode_record(record), self.pg, self.arrivals,
                             f"rank {record.rank}'s exchange of version {record.version}'s records with its EC column")
        records = [_decode(CommitRecord, info) for info in infos]
        lengths = [r.plan.nbytes for r in records]
        return lengths, records, piece_size(lengths, self.group.k)

    def protect(self, record: CommitRecord, data: np.ndarray, parity: np.ndarray, slot: int, lengths: list[int],
                records: list[CommitRecord], piece: int) -> ParityRecord:
        """Send this member's pieces to their stripes' parity holders, receive the pieces
        of the stripes it holds parity for, and encode them into ``parity`` (m pieces, in
        parity slot ``slot``)."""
        g = self.group
        # Every (data piece -> parity holder) move of the column, in one canonical order:
        # a move's index in it tags its messages, so both ends name it alike.
        moves = [(src, dest, stripe, q, p)
                 for stripe in range(g.n)
                 for q, dest in enumerate(g.parity_members(stripe))
                 for p, src in enumerate(g.data_members(stripe))]
        exchange = _Exchange(self, moves, data, lengths[self.position], parity, piece,
                             f"rank {record.rank}'s parity exchange of version {record.version} with its EC column")
        # In rounds: staging memory stays bounded whatever the state size, and a round's
        # pieces are still in cache when they are encoded. Round r+1's moves are under way
        # while round r encodes.
        width = max(ALIGN, EXCHANGE_ROUND // (g.m * g.k) // ALIGN * ALIGN)
        in_flight = None
        for r, start in enumerate(range(0, piece, width)):
            posted = exchange.post(r, start, min(width, piece - start))
            if in_flight is not None:
                exchange.finish(*in_flight)
            in_flight = posted
            if r == 0:  # the crash tests' "mid-exchange": pieces moved, no parity encoded or recorded yet
                exchange.finish(*in_flight)
                in_flight = None
                testhooks.at("mid_exchange", record.rank, record.version)
        if in_flight is not None:
            exchange.finish(*in_flight)
        # A piece that copies one member's data (k = 1) carries that member's own checksum: the
        # holder does not read it again, and the check at restore then compares what the holder
        # keeps with what the writer copied, end to end. An encoded piece is checksummed here.
        copy_of = [g.data_members(stripe)[0] if self.codec.copies(q) else -1 for stripe, q in exchange.held]
        sums = [records[src].checksum if src >= 0 else checksum(parity[i * piece : (i + 1) * piece])
                for i, src in enumerate(copy_of)]
        return ParityRecord(version=record.version, slot=slot, k=g.k, m=g.m, nodes=g.nodes,
                            piece_size=piece, lengths=tuple(lengths), records=tuple(records), checksums=tuple(sums),
                            copy_of=tuple(copy_of))

    def encode_again(self, record: CommitRecord, data: np.ndarray, slot: int) -> tuple[ParityRecord, np.ndarray]:
        """This member's parity of ``record``'s version, encoded again from the column's
        data (collective over the column), to keep in parity slot ``slot``: for members that
        lack it after a rebuild."""
        lengths, records, piece = self.exchange_info(record)
        parity = np.empty(self.parity_nbytes(piece), dtype=np.uint8)
        return self.protect(record, data, parity, slot, lengths, records, piece), parity

    def _all_to_all(self, recv: torch.Tensor, send: torch.Tensor, incoming: list, outgoing: list, piece: int) -> None:
        """Moves (source, destination, ...) are laid out by peer in both buffers."""
        n = self.group.n
        dist.all_to_all_single(
            recv, send,
            output_split_sizes=[piece * sum(1 for mv in incoming if mv[0] == i) for i in range(n)],
            input_split_sizes=[piece * sum(1 for mv in outgoing if mv[1] == j) for j in range(n)],
            group=self.pg)

    # -- rebuild ------------------------------------------------------------------
    def rebuild(self, has_data: set[int], has_parity: set[int], data: Optional[np.ndarray],
                parity: Optional[tuple[ParityRecord, np.ndarray]]) -> Optional[tuple[CommitRecord, np.ndarray]]:
        """Collective over the column: survivors send the pieces each lost member needs;
        a lost member decodes its data and gets its commit record back.

        The parity's geometry must fit the column's (:func:`plan_recovery` checked it on
        every rank alike before anything moves). Returns (record, data bytes) on a lost
        member, None on the others; the caller verifies the bytes against the record's
        checksum before using them.
        """
        g, pos, n, k = self.group, self.position, self.group.n, self.group.k
        metas: list = [None] * n
        dist.all_gather_object(metas, encode_record(parity[0]) if parity else None, group=self.pg)
        held = _decode(ParityRecord, next(m for m in metas if m is not None))
        piece, lengths, records = held.piece_size, held.lengths, held.records
        lost = [i for i in range(n) if i not in has_data]
        transfers = []  # (source, destination, stripe, code index), in one canonical order
        for dest in lost:
            for p in range(k):
                stripe = g.stripe_of_piece(dest, p)
                for src, code in stripe_sources(g, stripe, has_data, has_parity):
                    transfers.append((src, dest, stripe, code))
        outgoing = sorted((t for t in transfers if t[0] == pos), key=lambda t: t[1])
        incoming = sorted((t for t in transfers if t[1] == pos), key=lambda t: t[0])
        send = self._buffer("send", len(outgoing) * piece)
        send_np = send.numpy()
        for i, (_, _, stripe, code) in enumerate(outgoing):
            member_piece(g, pos, stripe, code, piece, data, lengths[pos], parity and parity[1],
                         send_np[i * piece : (i + 1) * piece])
        recv = self._buffer("recv", len(incoming) * piece)
        self._all_to_all(recv, send, incoming, outgoing, piece)
        if pos not in lost:
            return None
        recv_np = recv.numpy()
        received = {(s, code): recv_np[i * piece : (i + 1) * piece] for i, (_, _, s, code) in enumerate(incoming)}
        return records[pos], decode_member(self.codec, g, pos, held, has_data, has_parity,
                                           lambda stripe, code: received[(stripe, code)])


def member_piece(group: ECGroup, pos: int, stripe: int, code: int, piece: int, data: Optional[np.ndarray],
                 length: int, parity: Optional[np.ndarray], out: np.ndarray) -> np.ndarray:
    """Member ``pos``'s piece ``code`` of ``stripe``, into ``out``: a data piece (code < k) of
    its ``data`` (``length`` bytes, zeros past them), or one of the parity pieces it holds."""
    if code < group.k:
        ColumnCoder._put_piece(out, data, length, code * piece, piece)
    else:
        index = group.parity_held(pos).index((stripe, code - group.k))
        out[:] = parity[index * piece : (index + 1) * piece]
    return out


def decode_member(codec: Codec, group: ECGroup, pos: int, parity: ParityRecord, has_data: set[int],
                  has_parity: set[int], piece_of: Callable[[int, int], np.ndarray]) -> np.ndarray:
    """Member ``pos``'s data, decoded stripe by stripe from the pieces of each stripe's
    sources among the members that hold data and parity (:func:`stripe_sources`):
    ``piece_of(stripe, code)`` gives each; ``parity`` (any holder's record) gives the piece
    size and the members' lengths."""
    k, piece = group.k, parity.piece_size
    rebuilt = np.zeros(k * piece, dtype=np.uint8)
    for p in range(k):
        stripe = group.stripe_of_piece(pos, p)
        sources = stripe_sources(group, stripe, has_data, has_parity)
        available = {code: piece_of(stripe, code) for _, code in sources}
        codec.rebuild(available, {p: rebuilt[p * piece : (p + 1) * piece]})
    return rebuilt[: parity.lengths[pos]]


class _Exchange:
    """One protect's moves for one member: what it sends and receives in each round, and
    the encoding of what it received. The moves go point to point, so a piece leaves
    straight from the slot (staged only where it runs past the data, to pad with zeros),
    and a member that keeps one piece's copy as its parity (k = 1, as with 2 nodes and
    m = 1) receives it straight into its parity slot."""

    def __init__(self, coder: "ColumnCoder", moves: list, data: np.ndarray, length: int, parity: np.ndarray,
                 piece: int, what: str):
        """``what`` names the exchange where a peer does not come (:class:`Arrivals`)."""
        pos = coder.position
        self.coder, self.data, self.length, self.parity, self.piece = coder, data, length, parity, piece
        self.what = what
        self.tags = len(moves)
        self.outgoing = [(i, mv) for i, mv in enumerate(moves) if mv[0] == pos]
        self.incoming = [(i, mv) for i, mv in enumerate(moves) if mv[1] == pos]
        self.held = coder.group.parity_held(pos)
        self.into_parity = len(self.incoming) == 1 and len(self.held) == 1 and coder.codec.copies(self.held[0][1])
        self.peers = [dist.get_global_rank(coder.pg, i) for i in range(coder.group.n)]

    def post(self, r: int, start: int, width: int) -> tuple:
        """Start round ``r``'s sends and receives, bounded (the ranks to come, and its bytes at a
        crawl); (start, width, works, received, when posted, the bound)."""
        works, received = [], {}
        buffers = r % 2  # two rounds are in flight at most: each has buffers of its own
        bound_s = collective_timeout_s() + (len(self.outgoing) + len(self.incoming)) * width / NETWORK_FLOOR_BYTES_PER_S
        with posted_within(self.coder.pg, bound_s) as posted:
            for j, (tag, (_, dest, _, _, p)) in enumerate(self.outgoing):
                works.append(dist.isend(self._piece(p, start, width, f"send{buffers}.{j}"), self.peers[dest],
                                        group=self.coder.pg, tag=r * self.tags + tag))
            for j, (tag, (src, _, stripe, q, p)) in enumerate(self.incoming):
                into = torch.from_numpy(self.parity[start : start + width]) if self.into_parity else \
                    self.coder._buffer(f"recv{buffers}.{j}", width)
                received[(stripe, q, p)] = into
                works.append(dist.irecv(into, self.peers[src], group=self.coder.pg, tag=r * self.tags + tag))
        return start, width, works, received, posted, bound_s

    def finish(self, start: int, width: int, works: list, received: dict, posted: float, bound_s: float) -> None:
        """Wait for a round's moves and encode its parity rows."""
        self.coder.arrivals.wait(works, self.what, bound_s, posted)
        if self.into_parity:
            return
        piece, k = self.piece, self.coder.group.k
        for i, (stripe, q) in enumerate(self.held):
            sources = [received[(stripe, q, p)].numpy() for p in range(k)]
            self.coder.codec.encode_row(q, sources, self.parity[i * piece + start : i * piece + start + width])

    def _piece(self, p: int, start: int, width: int, buffer: str) -> torch.Tensor:
        """Bytes [start, start+width) of this member's piece ``p``: the slot's own where
        they lie within the data, else staged with zeros past it."""
        at = p * self.piece + start
        if at + width <= self.length:
            return torch.from_numpy(self.data[at : at + width])
        staged = self.coder._buffer(buffer, width)
        ColumnCoder._put_piece(staged.numpy(), self.data, self.length, at, width)
        return staged


def _decode(kind: type, payload: bytes):
    """A record a column peer sent; CorruptShard if it is none (a peer of another ftmem format)."""
    if not isinstance(payload, bytes):
        raise CorruptShard(f"a column peer sent {type(payload).__name__} where an encoded {kind.__name__} belongs.")
    try:
        return decode_record(kind, payload)
    except (ValueError, TypeError) as e:
        raise CorruptShard(f"a column peer sent an unreadable {kind.__name__} ({e}).") from e


def make_column_groups(topology: Topology, rank: int, interface: Optional[str]) -> Optional[dist.ProcessGroup]:
    """Create every column's gloo group (collective: all ranks, same order), its bytes on the
    network ``interface`` (see :func:`new_group`); return ours."""
    mine = None
    for g, local in topology.columns():
        ranks = topology.column_ranks(g, local)
        pg = new_group(ranks, interface=interface)
        if rank in ranks:
            mine = pg
    return mine


def with_slot(record: CommitRecord, slot: int) -> CommitRecord:
    return dataclasses.replace(record, slot=slot)
