"""Test-only stand-ins for the core calls: the same destination-passing contract, computed by the
fp64 reference on any device. ``install(monkeypatch)`` swaps them into xattn.torch.ops."""

import dataclasses

import torch

from tests.reference import attention as ref_attention, attention_bwd as ref_bwd, varlen_attention as ref_varlen
from tests.shared_queries import shared_query_rows
from xattn.core import paged
from xattn.core.checks import Memo, Meta, buffer_shapes, validate
from xattn.core.split_kv import CombineSpec
from xattn.torch import ops

CALLS = []
_FLOATS = ("float16", "bfloat16", "float32", "float64")


def validate_any_head_dim(family, direction, q: Meta, k: Meta, v: Meta, **kw):
    """The core's one validator (:func:`xattn.core.checks.validate`) on the call as the kernels would see
    it: bf16 for any float dtype, and head dims the family runs (unequal ones kept unequal, so FFPA still
    refuses them); the call's own dtype and head dims are put back into the spec. The stand-ins compute
    in fp64 at any head dim (d16 in the CPU tests); everything else (ranks, GQA, windows, varlen, sizes)
    is judged by the real validator."""
    d, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    kd, kdv = (512, 512 if dv == d else 496) if family == "ffpa" else (128, 128) if dv == d else (192, 128)

    def as_kernel(m: Meta, dim: int) -> Meta:
        return Meta((*m.shape[:-1], dim), "bfloat16" if m.dtype in _FLOATS else m.dtype)
    spec, problem = validate(family, direction, as_kernel(q, kd), as_kernel(k, kd if dk == d else kd + 16),
                             as_kernel(v, kdv), **kw)
    return dataclasses.replace(spec, dtype=q.dtype, head_dim=d, head_dim_v=dv), problem


def check_shapes_only(spec, problem, views) -> int:
    """The per-buffer check on any device: exact shapes only (devices, strides and alignment are CUDA's)."""
    for name, (shape, labels) in buffer_shapes(spec, problem).items():
        if name in views and tuple(views[name].shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} {labels}, got {tuple(views[name].shape)}")
    return 0


def _mask(spec):
    return spec.causal, (spec.window_left, spec.window_right)


def _skipped_rows_as_left(o, out, skipped, varlen):
    """``o`` with the rows that see no key (``skipped``, lse layout) as a skipping kernel leaves them in ``out``:
    0 where the caller pre-filled 0, else NaN (garbage on the GPU: only a combine, which skips lse -inf, may read
    such a partial)."""
    o = o.clone()
    rows = (lambda t: t[skipped.T]) if varlen else (lambda t: t.movedim(-1, 0)[:, skipped.movedim(-2, -1)].T)
    left = rows(out)  # [n, Dv]
    value = torch.where(left.ne(0).any(-1, keepdim=True), float("nan"), 0.0).to(o.dtype).expand_as(left)
    if varlen:
        o[skipped.T] = value
    else:
        o.movedim(-1, 0)[:, skipped.movedim(-2, -1)] = value.T
    return o


def _stub_fwd():
    def run(plan, q, k, v, out, lse, *, softmax_scale, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
            max_seqlen_k=None, stream=None):
        spec = plan[0]
        causal, window_size = _mask(spec)
        if getattr(spec, "shared_q", False):
            q = _shared_queries(q, cu_seqlens_q)
        if cu_seqlens_q is None:
            o, l_ = ref_attention(q, k, v, scale=softmax_scale, causal=causal, window=window_size)
        else:
            o, l_ = ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=softmax_scale, causal=causal,
                                window=window_size)
        skipped = torch.isneginf(l_)  # [.., Hq, N] (lse layout)
        if spec.output_fill():  # the kernels skip rows that see no key: the op must have pre-filled their lse
            assert torch.all(lse[skipped] == float("-inf")), "lse: rows that see no key were not pre-filled"
            # their out is left as it was; a row not pre-filled to 0 reads NaN here (garbage on the GPU), which
            # only a split partial may hold (the combine skips rows of lse -inf)
            o = _skipped_rows_as_left(o, out, skipped, spec.varlen)
        if cu_seqlens_q is None:
            out.copy_(o)
            lse.copy_(l_)
        else:  # as the kernels: no row past cu[-1] is written
            rows = int(cu_seqlens_q[-1])
            out[:rows].copy_(o[:rows])
            lse[:, :rows].copy_(l_[:, :rows])
        CALLS.append(("fwd", spec.family))
    return run


def _shared_queries(q, cu_seqlens_q):
    """The rows a split launch with ``shared_q`` reads (tests/shared_queries.py), as one q per slot."""
    return q[torch.tensor(shared_query_rows(cu_seqlens_q.tolist(), q.shape[0]), dtype=torch.long)]


def _stub_bwd():
    def run(plan, dout, q, k, v, out, lse, dq, dk, dv, *, workspace, softmax_scale, cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, stream=None):
        causal, window_size = _mask(plan[0])
        assert len(workspace) >= 2 and all(w.dtype == torch.float32 for w in workspace)
        if cu_seqlens_q is None:
            grads = ref_bwd(dout, q, k, v, out, lse, scale=softmax_scale, causal=causal, window=window_size)
        else:  # per segment, on [1, len, H, D] slices
            grads = [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)]
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            for s in range(len(cq) - 1):
                a, b, c, d = cq[s], cq[s + 1], ck[s], ck[s + 1]
                if b > a and d > c:
                    part = ref_bwd(dout[None, a:b], q[None, a:b], k[None, c:d], v[None, c:d], out[None, a:b],
                                   lse[None, :, a:b], scale=softmax_scale, causal=causal, window=window_size)
                    grads[0][a:b] += part[0][0]
                    grads[1][c:d] += part[1][0]
                    grads[2][c:d] += part[2][0]
        rows_q = dq.shape[0] if cu_seqlens_q is None else int(cu_seqlens_q[-1])  # no row past cu[-1] written
        rows_k = dk.shape[0] if cu_seqlens_k is None else int(cu_seqlens_k[-1])
        for dst, g, rows in zip((dq, dk, dv), grads, (rows_q, rows_k, rows_k)):
            dst[:rows].copy_(g[:rows])
        CALLS.append(("bwd", plan[0].family))
    return run


def install(monkeypatch):
    """The stand-ins in place of the core's launches and per-buffer checks, with fresh plan memos (a plan
    made under the stand-in validator must not outlive it)."""
    for name, value in _REPLACED.items():
        monkeypatch.setattr(ops, name, value())
    CALLS.clear()


def install_for_process():
    """:func:`install` for a whole process (subprocess tests: a ring rank, a spec recorder)."""
    for name, value in _REPLACED.items():
        setattr(ops, name, value())


def _stub_combine():
    def run(spec, out_partial, lse_partial, out, lse, stream=None):
        """The split-KV merge in fp64 (the combine kernel's contract: xattn.core.api.launch_combine); the route
        must have picked the combine's chunk for its P (xattn.core.split_kv.combine_chunk)."""
        from xattn.core.split_kv import combine_chunk

        assert spec.chunk == combine_chunk(out_partial.shape[0]), (spec.short_name(), out_partial.shape)
        lse_p = lse_partial.double()  # [P, B, Nq, Hq]
        total = torch.logsumexp(lse_p, dim=0)
        weight = torch.where(torch.isneginf(total), 0.0, torch.exp(lse_p - total)).nan_to_num(0.0)
        # as the kernel: a partial of weight 0 (lse -inf) is never read (a skipped split's out may hold anything)
        terms = torch.where(weight[..., None] > 0, weight[..., None] * out_partial.double(), 0.0)
        out.copy_(terms.sum(0))
        lse.copy_(total)
        CALLS.append(("combine", spec.family))
    return run


def _stub_slot_call(fwd, combine):
    def run(spec, q, k, v, out, lse, work, *, splits, softmax_scale, slot_bounds=None, cu_seqlens=None,
            stream=None):
        """The slot call's contract (xattn.core.api.launch_slot_call): the dense forward stand-in on the slot views
        (q batch stride 0, k/v slots ``c = Nk // S`` rows apart) into the partials, laid out in ``work`` as the
        launcher's docstring says, then the combine stand-in into out and lse. With a causal tail every slot views
        the last slot's keys and a mask keeps slot b < S - 1 to its own c keys (the non-causal stand-in on those) and
        the last slot causal on its keys (the causal dense stand-in)."""
        from xattn.core.spec import KernelSpec
        from xattn.core.split_kv import combine_chunk, slot_work_floats

        if spec.batched:
            return _batched(spec, q, k, v, out, lse, work, splits, softmax_scale, cu_seqlens)

        nq, hq, nk, dv = q.shape[1], q.shape[2], k.shape[1], v.shape[-1]
        c = nk // splits
        keys = nk - (splits - 1) * c if spec.tail else c
        assert (slot_bounds is not None) == spec.tail and (keys >= nq if spec.tail else nk % splits == 0)
        assert work.dtype == torch.float32 and work.shape[0] >= slot_work_floats(splits, nq, hq, dv)
        assert spec.chunk == combine_chunk(splits), (spec.short_name(), splits)
        slot = lambda t: t.as_strided((splits, keys, *t.shape[2:]), (c * t.stride(1), *t.stride()[1:]),  # noqa: E731
                                      t.storage_offset())
        q_slots = q.as_strided((splits, *q.shape[1:]), (0, *q.stride()[1:]), q.storage_offset())
        n = splits * nq * hq * dv // 2
        out_p = work[:n].view(q.dtype).view(splits, nq, hq, dv)
        lse_p = work[n:n + splits * hq * nq].view(splits, hq, nq)
        launch = spec.launch_spec()
        if not spec.tail:
            fwd((launch, None), q_slots, slot(k), slot(v), out_p, lse_p, softmax_scale=softmax_scale)
        else:
            assert slot_bounds.tolist() == [c, splits - 1]
            ks, vs, last = slot(k), slot(v), splits - 1
            fwd((launch, None), q_slots[:last], ks[:last, :c], vs[:last, :c], out_p[:last], lse_p[:last],
                softmax_scale=softmax_scale)
            causal = KernelSpec(launch.family, "fwd", launch.dtype, launch.head_dim, launch.head_dim_v,
                                launch.qhead_per_kvhead, True, False)
            fwd((causal, None), q_slots[last:], ks[last:], vs[last:], out_p[last:], lse_p[last:],
                softmax_scale=softmax_scale)
            del CALLS[-1]
        del CALLS[-1]
        combine(CombineSpec(spec.family, spec.dtype, dv, spec.chunk), out_p.unsqueeze(1),
                lse_p.permute(0, 2, 1).unsqueeze(1), out, lse.permute(0, 2, 1))
        CALLS[-1] = ("slot_call", spec.family)

    def _batched(spec, q, k, v, out, lse, work, splits, softmax_scale, cu_seqlens):
        """The batched slot call (xattn.core.slot_call_sm90, "Batched"): q copied per slot (shared_q: read from its
        own rows), the varlen stand-in on the flat key view by the call's own cu_seqlens, the dense causal stand-in on
        each sequence's last Nq keys into slot S, the combine stand-in, every buffer at the offsets of ``work`` the
        launcher's docstring gives."""
        from xattn.core.split_kv import combine_chunk, slot_work_floats

        b, nq, hq, d = q.shape
        nk, dv, parts = k.shape[1], v.shape[-1], splits + spec.tail
        n = b * parts * nq
        assert spec.chunk == combine_chunk(parts), (spec.short_name(), parts)
        assert work.dtype == torch.float32 and work.shape[0] >= slot_work_floats(parts, nq, hq, dv, b, d)
        cu_q, cu_k = cu_seqlens
        assert cu_q.shape == cu_k.shape == (b * (parts + 1) + 1,) and int(cu_q[-1]) == n
        rows = k.stride(0) // k.stride(1) if b > 1 else nk
        flat = lambda t: t.as_strided((rows * (b - 1) + nk, *t.shape[2:]), t.stride()[1:],  # noqa: E731
                                      t.storage_offset())
        if spec.shared_q:  # FA4's decode tile reads q's own rows, its sequences Nq rows apart (nothing in work)
            assert q.stride(0) == nq * q.stride(1), q.stride()
            q_split = q.as_strided((b * nq, hq, d), q.stride()[1:], q.storage_offset())
        else:  # the broadcast's slots (the tail's slot left as it was: its split document has no key)
            slots = work[:n * hq * d // 2].view(q.dtype).view(b, parts, nq, hq, d)
            slots[:, :splits] = q.unsqueeze(1)
            q_split = slots.view(n, hq, d)
        at = n * hq * d // 2
        out_p = work[at:at + n * hq * dv // 2].view(q.dtype).view(n, hq, dv)
        lse_p = work[at + n * hq * dv // 2:at + n * hq * dv // 2 + hq * n].view(hq, n)
        lse_p.fill_(float("-inf"))  # (the stand-in's pre-fill check: the kernel leaves keyless rows as they are)
        fwd((spec.launch_spec(), None), q_split, flat(k), flat(v), out_p, lse_p,
            softmax_scale=softmax_scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=nq, max_seqlen_k=nk)
        out_s, lse_s = out_p.view(b, parts, nq, hq, dv), lse_p.view(hq, b, parts, nq)
        if spec.tail:
            fwd((spec.tail_spec(), None), q, k[:, nk - nq:], v[:, nk - nq:], out_s[:, splits],
                lse_s[:, :, splits].permute(1, 0, 2), softmax_scale=softmax_scale)
        del CALLS[-1 - spec.tail:]
        combine(CombineSpec(spec.family, spec.dtype, dv, spec.chunk), out_s.transpose(0, 1),
                lse_s.permute(2, 1, 3, 0), out, lse.permute(0, 2, 1))
        CALLS[-1] = ("slot_call", spec.family)
    return run


def _stub_paged():
    def run(spec, q, k_pool, v_pool, kv_meta, out, lse, *, softmax_scale, cu_seqlens_q=None, stream=None):
        """A paged forward in fp64 (xattn.core.api.launch_paged_fwd's contract): row b reads its first
        kv_meta[b, 0] keys through its page-table columns kv_meta[b, 1:]; masks bottom-right aligned on them.
        Varlen: sequence b's queries are rows cu_seqlens_q[b]..[b + 1] (as [1, n, H, D]; lse [Hq, Tq])."""
        assert (cu_seqlens_q is not None) == spec.varlen
        if spec.varlen:
            cu = cu_seqlens_q.tolist()
            views = [(q[None, a:z], out[None, a:z], lse[:, a:z].unsqueeze(0)) for a, z in zip(cu, cu[1:])]
        else:
            views = [(q[b:b + 1], out[b:b + 1], lse[b:b + 1]) for b in range(q.shape[0])]
        ps = spec.page_size
        k4 = k_pool.view(-1, ps, *k_pool.shape[-2:]) if k_pool.dim() == 3 else k_pool  # FFPA: the flat view
        v4 = v_pool.view(-1, ps, *v_pool.shape[-2:]) if v_pool.dim() == 3 else v_pool
        meta = kv_meta.tolist()
        causal, window = _mask(spec)
        for b, row in enumerate(meta):
            n, pages = row[0], row[1:1 + -(-row[0] // ps)]
            assert 0 <= n <= (len(row) - 1) * ps and all(0 <= p < k4.shape[0] for p in pages), (b, row)
            q_b, out_b, lse_b = views[b]
            if n == 0:  # no key: FFPA leaves the row as pre-filled (out not 0: NaN here), FA4 writes 0 / -inf
                if spec.output_fill():
                    assert torch.all(torch.isneginf(lse_b)), "lse not pre-filled"
                    out_b.copy_(torch.where(out_b.ne(0).any(), float("nan"), 0.0))
                else:
                    out_b.zero_()
                lse_b.fill_(float("-inf"))
                continue
            k = k4[pages].reshape(-1, *k4.shape[-2:])[:n]
            v = v4[pages].reshape(-1, *v4.shape[-2:])[:n]
            o, l_ = ref_attention(q_b, k[None], v[None], scale=softmax_scale, causal=causal, window=window)
            out_b.copy_(o)
            lse_b.copy_(l_)
        CALLS.append(("paged", spec.family))
    return run


def _stub_paged_meta():
    def run(spec, lengths, page_table, kv_meta, tail_meta, lse_fill, packed=None, *, page_size, seqlen_q,
            tiles_per_page=1, stream=None):
        """The index kernel's contract (xattn.core.api.launch_paged_meta) from the core's host rule
        (xattn.core.paged.entry_bounds): entry s * B + b, its keys then its table columns (0 past the table), the
        table's pages read as ``tiles_per_page`` pages of ``page_size`` rows each."""
        r = tiles_per_page
        table = [[p * r + j for p in row for j in range(r)] for row in page_table.tolist()]
        b, columns = page_table.shape[0], page_table.shape[1] * r
        s, pps = kv_meta.shape[0] // b, kv_meta.shape[1] - 1
        plan = paged.PagedPlan(s, pps, spec.tail, s * pps != columns)
        for i, n in enumerate(lengths.tolist()):
            bounds = paged.entry_bounds(plan, n, seqlen_q, page_size)
            row = table[i] + [0] * (s * pps + tail_meta.shape[1] - columns)
            for j, (first, keys) in enumerate(bounds[:s]):
                kv_meta[j * b + i] = torch.tensor([keys] + row[first:first + pps])
            if spec.tail:
                first, keys = bounds[s]
                cols = [table[i][min(first + c, columns - 1)] for c in range(tail_meta.shape[1] - 1)]
                tail_meta[i] = torch.tensor([keys] + cols)
        lse_fill.fill_(float("-inf"))
        assert (packed is not None) == spec.packed
        _packed_gathers(packed, b, seqlen_q)
        CALLS.append(("paged_meta", spec.family))
    return run


def _packed_gathers(packed, b, nq):
    """The packed queries' gathers (xattn.core.split_kv "Packed queries"), host loops: dense row (i, k) reads packed
    row cu[i + 1] - Nq + k (clamped), packed row t of sequence i reads dense row i Nq + k back, others the sentinel
    B Nq; the zero row zeroed."""
    if packed is None:
        return
    cu_q, q_rows, out_rows, zero = packed
    cu, tq = cu_q.tolist(), out_rows.shape[0]
    out_rows.fill_(b * nq)
    for i in range(b):
        for k in range(nq):
            t = cu[i + 1] - nq + k
            q_rows[i * nq + k] = min(max(t, 0), tq - 1)
            if cu[i] <= t < tq:
                out_rows[t] = i * nq + k
    zero.zero_()


def _stub_split_meta():
    def run(spec, keys, cu_k, tail_k, lse_fill, packed=None, *, batch, rows, key_rows, seqlen_q, splits, chunk,
            stream=None):
        """The contiguous index kernel's contract (xattn.core.api.launch_split_meta) from the torch formulation it
        replaced (xattn.torch.split_kv.device_cu_seqlens_k) and host loops for the packed gathers."""
        from xattn.core.split_kv import SplitPlan
        from xattn.torch.split_kv import device_cu_seqlens_k

        assert (packed is not None) == spec.packed
        plan = SplitPlan(splits, spec.tail, chunk)
        lengths, starts = (keys[1:] - keys[:-1], keys[:-1]) if rows < 0 else (keys, None)
        want, want_tail = device_cu_seqlens_k(plan, seqlen_q, max(rows, 0), key_rows, lengths, starts)
        cu_k.copy_(want)
        if spec.tail:
            tail_k.copy_(want_tail)
        lse_fill.fill_(float("-inf"))
        _packed_gathers(packed, batch, seqlen_q)
        CALLS.append(("split_meta", spec.family))
    return run


def paged_spec_any_head_dim(family, dtype, d, dv, g, causal, left, right, page_size, varlen=False):
    """The paged support check as the kernels would see the call (bf16, a head dim the family runs), with the
    call's own dtype and head dims put back (the stand-in computes in fp64 at any)."""
    real = (d, dv) if d == dv and (d in (64, 96, 128, 192, 256) if family == "fa4" else 320 <= d <= 512) else None
    kd, kdv = real or ((512, 512) if family == "ffpa" else (128, 128))  # a real head dim keeps its own rules
    spec = _real_paged_spec(family, "bfloat16", kd, kdv, g, causal, left, right, page_size, varlen)
    return dataclasses.replace(spec, dtype=dtype, head_dim=d, head_dim_v=dv)


_real_paged_spec = ops.paged_spec
_REPLACED = {
    "LAUNCH": lambda: {"fwd": _stub_fwd(), "bwd": _stub_bwd(), "combine": _stub_combine(), "paged": _stub_paged(),
               "paged_meta": _stub_paged_meta(), "split_meta": _stub_split_meta(),
               "slot_call": _stub_slot_call(_stub_fwd(), _stub_combine())},
    "validate": lambda: validate_any_head_dim,
    "paged_spec": lambda: paged_spec_any_head_dim,
    "check_buffers": lambda: check_shapes_only,
    "_CHECKED": Memo,
    "_FWD_SETUPS": Memo,
    "_SLOT_CALLS": Memo,
}


def _core_plan(family, direction, q, k, v, causal, window_size, cu_q, cu_k, max_q, max_k):
    meta = lambda t: Meta(tuple(t.shape), str(t.dtype).removeprefix("torch."))  # noqa: E731
    cu = {} if cu_q is None and cu_k is None else dict(
        cu_seqlens_q=None if cu_q is None else meta(cu_q), cu_seqlens_k=None if cu_k is None else meta(cu_k),
        max_seqlen_q=max_q, max_seqlen_k=max_k)
    return validate_any_head_dim(family, direction, meta(q), meta(k), meta(v), causal=causal, window=window_size,
                                 allow_no_keys=True, **cu)


def core_fwd(family):
    """A stand-in of the core's public ``xc.<family>_fwd`` (the fuzz harness calls the core directly): the
    call judged by :func:`validate_any_head_dim`, then computed in fp64 as the launch stand-in."""
    run = _stub_fwd()

    def call(q, k, v, out, lse, *, softmax_scale, causal=False, window_size=(None, None), cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, stream=None, check_inputs=None):
        plan = _core_plan(family, "fwd", q, k, v, causal, window_size, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k)
        run(plan, q, k, v, out, lse, softmax_scale=softmax_scale, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return call


def core_bwd(family):
    """A stand-in of the core's public ``xc.<family>_bwd``, as :func:`core_fwd`."""
    run = _stub_bwd()

    def call(dout, q, k, v, out, lse, dq, dk, dv, *, softmax_scale, causal=False, window_size=(None, None),
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, workspace=None, stream=None,
             check_inputs=None):
        plan = _core_plan(family, "bwd", q, k, v, causal, window_size, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k)
        run(plan, dout, q, k, v, out, lse, dq, dk, dv, workspace=workspace, softmax_scale=softmax_scale,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return call
