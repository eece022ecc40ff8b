"""Erasure-coding groups across nodes and the stripe layout inside a group.

Groups are formed from nodes, never from ranks of one node, so one node loss costs
a group at most one member. With N nodes and group size n = k+m, the nodes form
N // n groups; when N is not a multiple of n the leftover nodes join the groups
one each, round-robin. A group of size s then keeps m parity members and has
k_g = s - m >= k data members: it still survives any m losses and its memory
overhead m/k_g is at most the m/k the user asked for.

Parity is spread over all members (RAID-5/6 style rotation, see docs/design/erasure-coding.md): a member's
data is cut into k_g pieces; in stripe s = 0..n-1 the members s..s+k_g-1 (mod n)
contribute a piece each and members s+k_g..s+n-1 (mod n) hold the stripe's m parity
pieces. Every member so holds m pieces of parity, m/k_g of its own data volume.
"""
from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True)
class ECGroup:
    nodes: tuple[int, ...]
    m: int

    @property
    def n(self) -> int:
        return len(self.nodes)

    @property
    def k(self) -> int:
        return self.n - self.m

    def stripe_of_piece(self, position: int, piece: int) -> int:
        """The stripe that piece ``piece`` (0..k-1) of member ``position`` belongs to."""
        return (position - piece) % self.n

    def data_members(self, stripe: int) -> list[int]:
        """Positions contributing to ``stripe``, in piece order."""
        return [(stripe + p) % self.n for p in range(self.k)]

    def parity_members(self, stripe: int) -> list[int]:
        """Positions holding parity 0..m-1 of ``stripe``."""
        return [(stripe + self.k + q) % self.n for q in range(self.m)]

    def parity_held(self, position: int) -> list[tuple[int, int]]:
        """(stripe, parity index) pairs that member ``position`` holds, in storage order."""
        return [((position - self.k - q) % self.n, q) for q in range(self.m)]


def ec_groups(num_nodes: int, k: int, m: int) -> list[ECGroup]:
    """Partition nodes 0..num_nodes-1 into EC groups (see the module docstring).

    ``k`` and ``m`` come from :meth:`ftmem.config.ECConfig.resolve`, which has checked
    them against the node count. With m = 0 every node is a group of its own.
    """
    n = k + m
    if m == 0:
        return [ECGroup(nodes=(node,), m=0) for node in range(num_nodes)]
    members = [list(range(g * n, (g + 1) * n)) for g in range(num_nodes // n)]
    for i, node in enumerate(range(len(members) * n, num_nodes)):
        members[i % len(members)].append(node)
    return [ECGroup(nodes=tuple(sorted(g)), m=m) for g in members]
