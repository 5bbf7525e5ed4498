"""Destination-passing attention calls on DLPack buffers: the whole public core.

Glossary: B batch, Nq/Nk sequence lengths, Tq/Tk packed tokens (varlen), Hq/Hkv heads
(Hq % Hkv == 0), D q/k head dim, Dv v head dim. Layouts follow FlashAttention:
dense ``[B, N, H, D]``, varlen ``[T, H, D]`` with int32 ``cu_seqlens`` ``[B + 1]``;
lse is fp32 ``[B, Hq, Nq]`` (dense) or ``[Hq, Tq]`` (varlen), natural log.
Causal masks are bottom-right aligned when Nq != Nk (query i sees keys
j <= i + Nk - Nq), as in FlashAttention; torch SDPA and ``jax.nn`` are top-left.

Every call validates all buffers first (see :mod:`xattn.core.checks`), compiles the
launcher for its :class:`KernelSpec` on first use, then enqueues the kernels:

* ``stream=None``: on the producer's current stream (torch: ``torch.cuda.current_stream()``;
  other producers: the TVM-FFI environment stream, by default the legacy default stream);
* ``stream=<int cudaStream_t>``: on that stream.

Edge sizes: a call without query rows (B = 0, Nq = 0 or Tq = 0) is validated and launches
nothing, so no output is written (zero dq/dk/dv first, FA4's included: their gradient is 0);
query rows without any key (Nk = 0 or Tk = 0) are refused by name, since the kernels have no
launch for them (the front ends return out 0 / lse -inf, the "rows that see no key" rule).
Sizes past the kernels' 32-bit indexing or the CUDA grid raise ``ValueError`` (see
:func:`xattn.core.checks.check_sizes`).

Nothing is allocated here: outputs and workspace come from the caller. cu_seqlens
values are not read on the host (that would synchronise): the caller guarantees
``0 = cu[0] <= cu[1] <= ... <= cu[B] <= T`` and segment lengths <= max_seqlen. A call that
breaks this is not detected: the kernels read/write outside the segments or the tensors
(wrong results, or an illegal memory access that kills the CUDA context). Checked mode
(``check_inputs=True`` on the varlen calls, or ``XATTN_CHECK_INPUTS=1`` when it is None)
copies both cu_seqlens to the host through DLPack first and raises a ``ValueError`` naming
the first bad index (:mod:`xattn.core.varlen_check`); dense calls ignore it.
"""

from __future__ import annotations

import tvm_ffi

from .cache import get_launcher
from .checks import (Meta, Problem, as_tensor, check_attention, check_layout_sizes, check_scale, check_window,
                     check_workspace, quick_check, validate)
from .spec import KernelSpec, supports
from .paged import PagedMetaSpec
from .split_kv import MAX_PARTIALS, CombineSpec, SlotCallSpec, SplitMetaSpec, slot_work_floats
from .varlen_check import check_host, checking
from .workspace import bwd_workspace_shapes

__all__ = ["ffpa_fwd", "ffpa_bwd", "fa4_fwd", "fa4_bwd", "bwd_workspace", "launch_fwd", "launch_bwd", "launch_combine",
           "launch_paged_fwd", "launch_paged_meta", "launch_split_meta", "launch_slot_call"]


def _workspace_layout(spec: KernelSpec, p: Problem):
    layout = bwd_workspace_shapes(spec, p.batch, p.seqlen_q, p.seqlen_k, p.total_q, p.total_k,
                                  p.heads_q, p.heads_kv)
    check_layout_sizes(layout)  # a dim past int32 is refused before anyone allocates it
    return layout


def bwd_workspace(family: str, q_shape, k_shape, *, head_dim_v: int | None = None,
                  causal: bool = False, window_size=(None, None), num_seqs: int | None = None):
    """Scratch buffers of a backward call, ``[(name, shape, dtype, fill), ...]`` in ``workspace=`` order.

    ``q_shape``/``k_shape`` are ``[B, Nq, Hq, D]``/``[B, Nk, Hkv, D]`` (dense) or
    ``[Tq, Hq, D]``/``[Tk, Hkv, D]`` (varlen: also give ``num_seqs`` = B). ``head_dim_v``
    defaults to D; ``causal``/``window_size`` as in the call (FA4 tiles depend on them).
    ``fill`` is ``None`` (any content) or the value every element must hold before the
    call (FA4's GQA dK/dV accumulators start at 0). Contents afterwards are unspecified.
    """
    q_shape, k_shape = tuple(int(s) for s in q_shape), tuple(int(s) for s in k_shape)
    if len(q_shape) not in (3, 4) or len(k_shape) != len(q_shape):
        raise ValueError(f"q_shape/k_shape: expected [B, N, H, D] or [T, H, D] each, got {q_shape} / {k_shape}")
    varlen = len(q_shape) == 3
    if varlen and num_seqs is None:
        raise ValueError("num_seqs: required for varlen shapes [T, H, D]")
    hq, d, hkv = q_shape[-2], q_shape[-1], k_shape[-2]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"k_shape: Hkv={hkv} must divide Hq={hq}")
    v_shape = (*k_shape[:-1], head_dim_v or d)
    cu = {}
    if varlen:
        cu = dict(cu_seqlens_q=Meta((num_seqs + 1,), "int32"), cu_seqlens_k=Meta((num_seqs + 1,), "int32"),
                  max_seqlen_q=0, max_seqlen_k=0)
    spec, p = validate(family, "bwd", Meta(q_shape, "bfloat16"), Meta(k_shape, "bfloat16"), Meta(v_shape, "bfloat16"),
                       causal=bool(causal), window=window_size, allow_no_keys=True, **cu)
    return _workspace_layout(spec, p)


def _check_stream(stream) -> None:
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int)):
        raise TypeError(f"stream: expected None or an int cudaStream_t, got {type(stream).__name__}")


def _launch(launcher, problem, args, scale, stream, diagnose) -> None:
    """Enqueue; if the launcher's own C-side argument checks refuse, explain by name."""
    if problem.total_q == 0:
        diagnose()  # nothing launches, so the launcher's C-side checks never see the buffers
        return  # no query rows: nothing to write
    try:
        if stream is None:  # the producers' objects: TVM-FFI adopts e.g. torch's current stream
            launcher.function(*args, scale)
        else:
            views = [as_tensor(a, "buffer") for a in args]
            with tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", problem.device_index), stream):
                launcher.function(*views, scale)
    except (ValueError, TypeError):
        diagnose()  # raises a ValueError/TypeError naming the argument
        raise


def _fwd(family, q, k, v, out, lse, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k,
         max_seqlen_q, max_seqlen_k, window, stream, check_inputs):
    _check_stream(stream)
    scale = check_scale(softmax_scale)
    raw = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
    varlen_args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window)
    checked = quick_check(family, "fwd", raw, causal, *varlen_args) or \
        check_attention(family, "fwd", raw, causal, *varlen_args)[:2]
    if checked[0].varlen and checking(check_inputs):
        check_host(cu_seqlens_q, cu_seqlens_k, checked[1].total_q, checked[1].total_k, max_seqlen_q, max_seqlen_k)
    launch_fwd(checked, q, k, v, out, lse, softmax_scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, stream=stream)


def _bwd(family, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, cu_seqlens_q,
         cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, workspace, stream, check_inputs):
    _check_stream(stream)
    scale = check_scale(softmax_scale)
    raw = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    varlen_args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window)
    checked = quick_check(family, "bwd", raw, causal, *varlen_args) or \
        check_attention(family, "bwd", raw, causal, *varlen_args)[:2]
    if checked[0].varlen and checking(check_inputs):
        check_host(cu_seqlens_q, cu_seqlens_k, checked[1].total_q, checked[1].total_k, max_seqlen_q, max_seqlen_k)
    launch_bwd(checked, dout, q, k, v, out, lse, dq, dk, dv, workspace=workspace, softmax_scale=scale,
               cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
               max_seqlen_k=max_seqlen_k, stream=stream)


def launch_fwd(checked, q, k, v, out, lse, *, softmax_scale: float, cu_seqlens_q=None, cu_seqlens_k=None,
               max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, stream: int | None = None) -> None:
    """Enqueue the forward of a call that :func:`~xattn.core.checks.validate` accepted: ``checked`` is its
    ``(spec, problem)``, ``softmax_scale`` a float that :func:`~xattn.core.checks.check_scale` returned.

    The front ends' entry (they validate once per call, allocate, then launch here); :func:`ffpa_fwd`
    and :func:`fa4_fwd` are validation + this. The buffers' dtypes, shapes, strides, alignment and
    device are checked in C by the launcher before any kernel starts; a refusal is explained by name
    (:func:`~xattn.core.checks.check_attention`). cu_seqlens values are trusted (see the module docstring).
    """
    spec, problem = checked
    if stream is not None:
        _check_stream(stream)
    args = (q, k, v, out, lse) if not spec.varlen else (q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse)
    window = (spec.window_left, spec.window_right)

    def diagnose():
        check_attention(spec.family, "fwd", {"q": q, "k": k, "v": v, "out": out, "lse": lse}, spec.causal,
                        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window)
    _launch(get_launcher(spec), problem, args, softmax_scale, stream, diagnose)


def launch_bwd(checked, dout, q, k, v, out, lse, dq, dk, dv, *, workspace, softmax_scale: float, cu_seqlens_q=None,
               cu_seqlens_k=None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
               stream: int | None = None) -> None:
    """Enqueue the backward of a validated call, as :func:`launch_fwd`; ``workspace`` is the list of
    buffers :func:`bwd_workspace` describes (their shapes are checked here: C does not check their rows)."""
    spec, problem = checked
    if stream is not None:
        _check_stream(stream)
    raw = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    window = (spec.window_left, spec.window_right)
    workspace = None if workspace is None else list(workspace)
    layout = _workspace_layout(spec, problem)

    def diagnose():
        _, checked, _ = check_attention(spec.family, "bwd", raw, spec.causal, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, window)
        check_workspace(workspace, layout, checked.device_index)
    if workspace is None or len(workspace) != len(layout) or any(
            as_tensor(x, n).shape != shape for x, (n, shape, _, _) in zip(workspace, layout)):
        diagnose()  # names the bad buffer (the rows dim of workspace is not checked in C)
    args = [dout, q, k, v, out, lse]
    if spec.varlen:
        args += [cu_seqlens_q, cu_seqlens_k]
    args += [dq, dk, dv, *workspace]
    _launch(get_launcher(spec), problem, args, softmax_scale, stream, diagnose)


def launch_combine(spec: CombineSpec, out_partial, lse_partial, out, lse, *, stream: int | None = None) -> None:
    """Enqueue the split-KV merge (:mod:`xattn.core.split_kv`): reads ``out_partial [P, B, Nq, Hq, Dv]``
    (``spec.dtype``) and ``lse_partial [P, B, Nq, Hq]`` (fp32, Nq stride 1), writes every element of
    ``out [B, Nq, Hq, Dv]`` and ``lse [B, Nq, Hq]`` (fp32, Nq stride 1; views of ``[B, Hq, Nq]``). Strided
    views are read as they are; dtypes, shapes and strides are checked in C by the launcher."""
    if stream is not None:
        _check_stream(stream)
    parts = int(out_partial.shape[0])
    if not 1 <= parts <= MAX_PARTIALS:
        raise ValueError(f"out_partial: 1-{MAX_PARTIALS} partial slots, got {parts}")
    function = get_launcher(spec).function
    if stream is None:
        function(out_partial, lse_partial, out, lse, 0.0)
        return
    views = [as_tensor(a, "buffer") for a in (out_partial, lse_partial, out, lse)]
    with tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", views[2].device.index), stream):
        function(*views, 0.0)


def launch_paged_fwd(spec: KernelSpec, q, k_pages, v_pages, kv_meta, out, lse, *, softmax_scale: float,
                     cu_seqlens_q=None, stream: int | None = None) -> None:
    """Enqueue a paged-KV forward (:mod:`xattn.core.paged_sm90`, ``spec.page_size`` set): q ``[B, Nq, Hq, D]``
    (varlen spec: ``[Tq, Hq, D]`` with ``cu_seqlens_q`` int32 ``[B + 1]``), the pools (FFPA: ``[NP*PS, Hkv, D]``,
    the flat view of its pages; FA4: ``[NP, PS, Hkv, D]``), ``kv_meta [B, 1 + P]`` int32 (row b: its keys, then
    its page table; values trusted, :mod:`xattn.core.paged`); writes out ``[B, Nq, Hq, Dv]`` / ``[Tq, Hq, Dv]``
    and lse ``[B, Hq, Nq]`` / ``[Hq, Tq]`` fp32, pre-filled by the caller as :meth:`KernelSpec.output_fill` says.
    Buffers are checked in C by the launcher."""
    reason = supports(spec)
    if spec.page_size is None or reason:
        raise ValueError(f"launch_paged_fwd: {spec.short_name()} is not a paged forward ({reason or 'page_size None'})")
    if (cu_seqlens_q is None) == spec.varlen:
        raise ValueError(f"cu_seqlens_q: {'required' if spec.varlen else 'not taken'} by {spec.short_name()}")
    args = (q, k_pages, v_pages, kv_meta, out, lse) if not spec.varlen else \
        (q, k_pages, v_pages, cu_seqlens_q, kv_meta, out, lse)
    function = get_launcher(spec).function
    if stream is None:
        function(*args, softmax_scale)
        return
    _check_stream(stream)
    views = [as_tensor(a, "buffer") for a in args]
    with tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", views[0].device.index), stream):
        function(*views, softmax_scale)


def launch_paged_meta(spec: PagedMetaSpec, lengths, page_table, kv_meta, tail_meta, lse_fill, packed=None, *,
                      page_size: int, seqlen_q: int, tiles_per_page: int = 1, stream: int | None = None) -> None:
    """Enqueue the paged split route's index kernel (:mod:`xattn.core.paged_meta_sm90`): from ``lengths [B]`` and
    ``page_table [B, P]`` (int32, any strides) write the split entries' ``kv_meta [S*B, 1+pps]`` (int32, row
    ``s * B + b``: its keys, then table columns ``s*pps..``, 0 past the table), with ``spec.tail`` the causal tail's
    ``tail_meta [B, 1+W]`` (otherwise any int32 tensor, untouched), and -inf into every element of ``lse_fill [F]``
    fp32. With ``spec.packed``, ``packed = (cu_seqlens_q [B+1], q_rows [B*Nq], out_rows [Tq], zero [Z])`` int32:
    the packed queries' gathers, as the module says (otherwise None). ``page_size`` and
    ``seqlen_q`` (Nq) as the plan's (:func:`xattn.core.paged.entry_bounds`); with ``tiles_per_page`` r > 1 the
    pool's pages are read as r pages of ``page_size`` rows each (table column c: ``page_table[b, c // r] * r +
    c % r``)."""
    if page_size < 1 or seqlen_q < 1 or tiles_per_page < 1:
        raise ValueError(f"launch_paged_meta: page_size {page_size}, seqlen_q {seqlen_q} and tiles_per_page "
                         f"{tiles_per_page} must be >= 1")
    if (packed is not None) != spec.packed or (packed is not None and len(packed) != 4):
        raise ValueError(f"launch_paged_meta: {spec.short_name()} takes "
                         f"{'the five packed gathers' if spec.packed else 'no packed gathers'}")
    extra = packed or (lengths,) * 4  # unused slots take any int32 vector: the lengths themselves
    args = (lengths, page_table, kv_meta, tail_meta, lse_fill, *extra, page_size, seqlen_q, tiles_per_page)
    function = get_launcher(spec).function
    if stream is None:
        function(*args)
        return
    _check_stream(stream)
    views = [as_tensor(a, "buffer") for a in args[:9]]
    with tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", views[0].device.index), stream):
        function(*views, page_size, seqlen_q, tiles_per_page)


def launch_split_meta(spec: SplitMetaSpec, keys, cu_k, tail_k, lse_fill, packed=None, *, batch: int, rows: int,
                      key_rows: int, seqlen_q: int, splits: int, chunk: int, stream: int | None = None) -> None:
    """Enqueue the contiguous split route's index kernel (:mod:`xattn.core.split_meta_sm90`): from ``keys`` (``rows >=
    0``: valid keys ``[B]``, sequence b from flat row ``b * rows``; ``rows < 0``: ``cu_seqlens_k [B+1]``) write the
    split launch's ``cu_k [B*(P+1)+1]`` and with ``spec.tail`` the tail launch's ``tail_k [2B+1]`` (int32;
    otherwise any int32 vector, untouched), -inf into every element of ``lse_fill [F]`` fp32, and with
    ``spec.packed`` the gathers ``packed = (cu_seqlens_q [B+1], q_rows [B*Nq], out_rows [Tq], zero [Z])``
    (:func:`launch_paged_meta`'s). ``splits`` S and ``chunk`` (0: each sequence its own) as the plan's,
    ``key_rows`` the flat key view's rows."""
    if batch < 1 or seqlen_q < 1 or splits < 1 or chunk < 0 or key_rows < 0:
        raise ValueError(f"launch_split_meta: batch {batch}, seqlen_q {seqlen_q}, splits {splits} must be >= 1, "
                         f"chunk {chunk} and key_rows {key_rows} >= 0")
    if (packed is not None) != spec.packed or (packed is not None and len(packed) != 4):
        raise ValueError(f"launch_split_meta: {spec.short_name()} takes "
                         f"{'the four packed gathers' if spec.packed else 'no packed gathers'}")
    extra = packed or (keys,) * 4  # unused slots take any int32 vector: the keys themselves
    args = (keys, cu_k, tail_k, lse_fill, *extra, batch, rows, key_rows, seqlen_q, splits, chunk)
    function = get_launcher(spec).function
    if stream is None:
        function(*args)
        return
    _check_stream(stream)
    views = [as_tensor(a, "buffer") for a in args[:8]]
    with tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", views[0].device.index), stream):
        function(*views, *args[8:])


def launch_slot_call(spec: SlotCallSpec, q, k, v, out, lse, work, *, splits: int, softmax_scale: float,
                     slot_bounds=None, cu_seqlens=None, stream: int | None = None) -> None:
    """Enqueue the split-KV route's slot call (:mod:`xattn.core.slot_call_sm90`): the slot launch of one sequence,
    with ``spec.tail`` its causal tail in the last slot, and the combine, one host function. Reads q ``[1, Nq, Hq,
    D]``, k/v ``[1, Nk, Hkv, D/Dv]`` (``spec.dtype``, any strides with a unit last one); writes every element of out
    ``[1, Nq, Hq, Dv]`` and lse ``[1, Hq, Nq]`` (f32, Nq stride 1), and ``work`` (f32, at least
    :func:`slot_work_floats` floats of P = S partials). ``splits`` S: dividing Nk without a tail; with one,
    ``slot_bounds`` int32 ``[2]`` on the device, ``[Nk // S, S - 1]`` (values trusted; the mask of the last slot),
    whose last slot ``Nk - (S - 1) (Nk // S)`` holds at least Nq keys. ``softmax_scale`` as :func:`launch_fwd`'s.

    ``spec.batched``: B >= 1 sequences of Nk keys each (q ``[B, Nq, Hq, D]``, k/v ``[B, Nk, Hkv, D]`` whose sequences
    are a whole number R >= Nk of rows apart, out and lse ``[B, ...]``) on the varlen split launch, ``cu_seqlens =
    (cu_q, cu_k)`` int32 ``[B (P + 1) + 1]`` on the device (:func:`~xattn.core.split_kv.split_cu_seqlens` of a
    filled plan of S splits; values trusted), the tail (if any) on each sequence's last Nq keys (Nk > Nq) into slot
    S (P = S + 1); ``work`` :func:`slot_work_floats` with ``batch`` and ``head_dim``; with ``spec.shared_q`` (FA4's
    decode tile) q's sequences Nq rows apart (``stride(0) == Nq stride(1)``: its rows read as ``[B Nq, Hq, D]``).
    Shapes, dtypes and strides are checked in C by the launcher, S, the tail, the index arrays' lengths, the key rows,
    q's rows and the work's size here."""
    b, nk, nq, hq, dv = q.shape[0], k.shape[1], q.shape[1], q.shape[2], v.shape[-1]
    for name, given, wanted in (("slot_bounds", slot_bounds, spec.tail and not spec.batched),
                                ("cu_seqlens", cu_seqlens, spec.batched)):
        if (given is not None) != wanted:
            raise ValueError(f"{name}: {'required' if wanted else 'not taken'} by {spec.short_name()}")
    keys = nk - nq if spec.tail and spec.batched else nk  # the splits' keys: every slot holds at least one
    parts = splits + int(spec.tail and spec.batched)  # one sequence: the tail is the last slot
    if spec.batched:
        rule, fits = "", True
    elif spec.tail:
        rule, fits = "leave the last slot Nq keys", splits < 1 or nk - (splits - 1) * (nk // splits) >= nq
    else:
        rule, fits = f"divide Nk {nk}", splits < 1 or nk % splits == 0
    if not 1 <= splits < MAX_PARTIALS or keys < splits or not fits:
        raise ValueError(f"launch_slot_call: splits must be in 1-{MAX_PARTIALS - 1}, at most the splits' keys "
                         f"({'Nk - Nq' if spec.tail and spec.batched else 'Nk'}){' and ' + rule if rule else ''}; "
                         f"got splits {splits}, Nq {nq}, Nk {nk}")
    if spec.batched:
        _check_batched(b, parts, cu_seqlens, k, v)
        qs = _strides(q)
        if spec.shared_q and b > 1 and qs[0] != nq * qs[1]:
            raise ValueError(f"launch_slot_call: {spec.short_name()} reads q as [B Nq, Hq, D] rows: its sequences must "
                             f"be Nq {nq} rows apart (stride(0) == Nq stride(1)); got strides {qs}")
        floats = slot_work_floats(parts, nq, hq, dv, b, q.shape[-1])
    else:
        floats = slot_work_floats(parts, nq, hq, dv)
    if len(work.shape) != 1 or work.shape[0] < floats:
        raise ValueError(f"work: expected at least {floats} floats (S {splits}, tail {spec.tail}, B {b}, Nq {nq}, "
                         f"Hq {hq}, Dv {dv}), got shape {tuple(work.shape)}")
    args = (q, k, v, *((slot_bounds,) if slot_bounds is not None else ()), *(cu_seqlens or ()), out, lse, work)
    function = get_launcher(spec).function
    if stream is None:
        function(*args, splits, softmax_scale)
        return
    _check_stream(stream)
    views = [as_tensor(a, "buffer") for a in args]
    with tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", views[0].device.index), stream):
        function(*views, splits, softmax_scale)


def _check_batched(b: int, parts: int, cu_seqlens, k, v) -> None:
    """The batched slot call's index arrays (``[B (P + 1) + 1]``) and flat key view: k's and v's sequences one whole
    number R >= Nk of rows apart (element strides)."""
    docs = b * (parts + 1) + 1
    for name, cu in zip(("cu_q", "cu_k"), cu_seqlens):
        if tuple(cu.shape) != (docs,):
            raise ValueError(f"cu_seqlens: {name} expected [{docs}] (B (P + 1) + 1), got shape {tuple(cu.shape)}")
    ks, vs, nk = _strides(k), _strides(v), k.shape[1]
    if b > 1 and not (ks[1] > 0 and ks[0] % ks[1] == 0 and ks[0] // ks[1] >= nk and vs[1] > 0
                      and vs[0] % vs[1] == 0 and vs[0] // vs[1] == ks[0] // ks[1]):
        raise ValueError(f"launch_slot_call: the batched call reads k and v as flat rows: their sequences must be one "
                         f"whole number (>= Nk {nk}) of rows apart; got strides k {ks}, v {vs}")


def _strides(t) -> tuple[int, ...]:
    """Element strides of a torch tensor (``stride()``, no conversion) or of any DLPack tensor (its TVM-FFI view)."""
    stride = getattr(t, "stride", None)
    return tuple(stride()) if callable(stride) else tuple(as_tensor(t, "k/v").strides)


def ffpa_fwd(q, k, v, out, lse, *, softmax_scale: float, causal: bool = False,
             window_size: tuple[int | None, int | None] = (None, None), cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
             stream: int | None = None, check_inputs: bool | None = None) -> None:
    """FFPA forward (head_dim 320-512, D == Dv), written into ``out`` and ``lse``.

    Reads q ``[B, Nq, Hq, D]``, k/v ``[B, Nk, Hkv, D]`` (or varlen ``[T, H, D]`` with
    ``cu_seqlens_q/k`` int32 ``[B + 1]`` and ``max_seqlen_q/k``), fp16/bf16.
    Writes out (q's dtype, q's layout) and lse (fp32, ``[B, Hq, Nq]`` / ``[Hq, Tq]``).

    Pre-initialisation, by the caller: for ``causal=True`` or varlen, ``out`` must hold
    zeros and ``lse`` -inf (the kernel skips fully masked tiles and empty segments).
    Dense non-causal calls overwrite every element.

    ``window_size`` is read as in :func:`fa4_fwd`; FFPA has no sliding-window kernel on sm90, so a
    bounded window raises ``NotImplementedError`` (``causal=True`` with ``(-1, -1)`` / ``(None, None)``
    is plain causal). It is accepted so that one call serves both families.

    ``check_inputs`` (varlen): ``True`` validates the cu_seqlens values before the launch (host
    copies, see the module docstring), ``False`` trusts them, ``None`` follows ``XATTN_CHECK_INPUTS``.
    """
    _fwd("ffpa", q, k, v, out, lse, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k,
         max_seqlen_q, max_seqlen_k, check_window(window_size), stream, check_inputs)


def ffpa_bwd(dout, q, k, v, out, lse, dq, dk, dv, *, softmax_scale: float, causal: bool = False,
             window_size: tuple[int | None, int | None] = (None, None), cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q: int | None = None,
             max_seqlen_k: int | None = None, workspace=None, stream: int | None = None,
             check_inputs: bool | None = None) -> None:
    """FFPA backward: writes dq ``[.., Hq, D]``, dk/dv ``[.., Hkv, D]`` (reduced over each GQA group).

    Uses exactly the ``out`` and ``lse`` given (e.g. the globally merged ones of ring
    attention); they are never recomputed. ``workspace`` is the list of buffers that
    :func:`bwd_workspace` ("ffpa", q.shape, k.shape, ...) describes (no init needed).

    Pre-initialisation, by the caller: ``dq``, ``dk`` and ``dv`` must hold zeros.
    ``window_size`` and ``check_inputs`` as in :func:`ffpa_fwd`.
    """
    _bwd("ffpa", dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, cu_seqlens_q,
         cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_window(window_size), workspace, stream, check_inputs)


def fa4_fwd(q, k, v, out, lse, *, softmax_scale: float, causal: bool = False,
            window_size: tuple[int | None, int | None] = (None, None), cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
            stream: int | None = None, check_inputs: bool | None = None) -> None:
    """FlashAttention-4 forward (sm90, head_dim <= 256, e.g. 128/128 or 192/128).

    Same layouts as :func:`ffpa_fwd`; v/out may have a different head dim Dv.
    ``window_size=(left, right)`` selects sliding-window (local) attention, bottom-right
    aligned like causal; ``None`` means unbounded on that side. ``causal=True`` with a left
    window is the window ``(left, 0)`` (causal = right window 0).
    No pre-initialisation needed: every element of out and lse is written.
    ``check_inputs`` as in :func:`ffpa_fwd`.
    """
    _fwd("fa4", q, k, v, out, lse, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k,
         max_seqlen_q, max_seqlen_k, check_window(window_size), stream, check_inputs)


def fa4_bwd(dout, q, k, v, out, lse, dq, dk, dv, *, softmax_scale: float, causal: bool = False,
            window_size: tuple[int | None, int | None] = (None, None), cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q: int | None = None,
            max_seqlen_k: int | None = None, workspace=None, stream: int | None = None,
            check_inputs: bool | None = None) -> None:
    """FlashAttention-4 backward: writes dq, dk, dv (dk/dv reduced over each GQA group).

    Uses exactly the ``out`` and ``lse`` given. ``workspace`` is the list of buffers that
    :func:`bwd_workspace` ("fa4", q.shape, k.shape, causal=..., ...) describes; under GQA
    its ``dk_accum``/``dv_accum`` must hold zeros (their ``fill``). dq, dk, dv need no
    pre-initialisation: every element is written. ``check_inputs`` as in :func:`ffpa_fwd`.
    """
    _bwd("fa4", dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, cu_seqlens_q,
         cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_window(window_size), workspace, stream, check_inputs)
