"""The q rows a shared-q split launch reads (xattn.core.split_q_sm90), for the CPU stand-ins of both front ends."""

from __future__ import annotations


def shared_query_rows(cu_q: list[int], q_rows: int) -> list[int]:
    """Row indices into q ``[B*Nq, Hq, D]`` that a shared-q split launch reads, in the order of the launch's rows:
    document i's Nq queries from row ``cu_q[i] // (cu_q[-1] // B) * Nq``, ``B = documents - cu_q[-1] // Nq`` (as
    the kernel derives them from its own cu_seqlens); empty documents read none. The launch computes as if q held
    one copy per slot (``cu_q[-1]`` rows): what the route used to copy."""
    index = []
    for a, b in zip(cu_q, cu_q[1:]):
        if b > a:
            seqs = (len(cu_q) - 1) - cu_q[-1] // (b - a)
            start = a // (cu_q[-1] // seqs) * (b - a)
            assert start + b - a <= q_rows, "the shared-q launch would read past q"
            index += range(start, start + b - a)
    return index
