"""The one route decision (xattn.core.routes): the measured table under auto, forced routes by name (raising
where they cannot serve), what each route serves, and the packed layouts."""

import pytest

from xattn.core import gemm_bwd_plan, routes


def dense(nk, g=8, causal=True, family="ffpa", d=512, dv=None, window=(None, None)):
    return routes.BwdProblem(family, d, dv or d, g, causal, window, "dense", seqlen_k=nk)


def packed(lens_q, lens_k=None, g=8, causal=True, tq=None, tk=None, capturing=False):
    lens_k = lens_q if lens_k is None else lens_k
    return routes.BwdProblem("ffpa", 512, 512, g, causal, kind="packed", lengths=(lens_q, lens_k),
                             total_q=tq or sum(lens_q), total_k=tk or sum(lens_k), heads_q=4 * g, capturing=capturing)


def traced(slots, max_q, max_k, tq, tk, same=True, causal=True, g=8):
    return routes.BwdProblem("ffpa", 512, 512, g, causal, kind="traced", total_q=tq, total_k=tk, slots=slots,
                             max_seqlen_q=max_q, max_seqlen_k=max_k, same_segments=same, heads_q=4 * g)


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)


def test_auto_follows_the_measured_table():
    assert routes.backward_route(dense(2048)).name == "gemm"
    assert routes.backward_route(dense(1024)).name == "fused"
    assert routes.backward_route(dense(4096, g=1)).name == "fused"
    assert routes.backward_route(dense(8192, g=1, causal=False)).name == "gemm"
    short = routes.backward_route(packed([512] * 8))
    assert short.name == "fused" and "keys per row's document 512" in short.reason
    assert routes.backward_route(dense(1 << 16, window=(128, 0))).name == "fused"
    fa4 = routes.backward_route(dense(1 << 16, family="fa4", d=128))
    assert fa4.name == "fused" and "fa4 keeps its own backward" in fa4.reason
    # the reasons of the routes not taken are there too (as TransformerEngine's backend choice gives them)
    assert dict(fa4.rejected())["gemm"].startswith("the GEMM backward covers FFPA")


@pytest.mark.parametrize("problem, name", [
    (packed([4096] * 4), "gemm-dense"),
    (packed([0, 4096, 0, 4096], tq=9000), "gemm-dense"),             # empty documents, trailing rows
    (packed([3000, 100, 5000, 17, 4000]), "gemm-segments"),           # self-attention, mixed lengths
    (packed([3000, 5000], [3100, 5000]), "gemm-groups+fused"),        # queries != keys
    (packed([4096] * 4, capturing=True), "fused"),                    # CUDA graph capture: no host lengths
    (traced(4, 2048, 2048, 8192, 8192), "gemm-padded"),
    (traced(4, 2048, 2048, 8192, 8192, same=False, causal=False), "gemm-padded"),
    (traced(4, 2048, 2048, 8192, 8192, same=False), "fused"),         # causal needs one cu_seqlens object
    (traced(16, 4096, 4096, 8192, 8192), "gemm-segments|fused"),      # loose max_seqlen, one object
    (traced(16, 4096, 4096, 8192, 8192, same=False, causal=False), "fused"),
    (traced(4, 1024, 1024, 4096, 4096), "fused"),                     # max_seqlen_k under the table
])
def test_auto_packed(problem, name):
    assert routes.backward_route(problem).name == name


def test_forced_routes_raise_where_they_cannot_serve(monkeypatch):
    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm")
    assert routes.backward_route(dense(64, g=1)).name == "gemm"
    assert routes.backward_route(packed([3000, 5000], [3100, 5000], g=1)).name == "gemm-groups"  # every group
    assert routes.backward_route(traced(16, 4096, 4096, 8192, 8192)).name == "gemm-segments"
    with pytest.raises(ValueError, match="sliding windows"):
        routes.backward_route(dense(64, window=(64, 0)))
    with pytest.raises(ValueError, match="fa4 keeps"):
        routes.backward_route(dense(64, family="fa4", d=128))
    with pytest.raises(ValueError, match="CUDA graph capture"):
        routes.backward_route(packed([4096] * 4, capturing=True))
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")
    assert routes.backward_route(dense(1 << 16)).name == "fused"
    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm-dense")
    with pytest.raises(ValueError, match="XATTN_BWD_ROUTE=gemm-dense: its documents are not all of one length"):
        routes.backward_route(packed([100, 200]))
    with pytest.raises(ValueError, match="not dense batches"):
        routes.backward_route(dense(4096))
    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm-segments")
    with pytest.raises(ValueError, match="self-attention"):
        routes.backward_route(traced(4, 2048, 2048, 8192, 8192, same=False))
    monkeypatch.setenv("XATTN_BWD_ROUTE", "fastest")
    with pytest.raises(ValueError, match="XATTN_BWD_ROUTE='fastest'"):
        routes.backward_route(dense(4096))


def test_the_test_hook_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")
    with routes.forced("gemm"):
        assert routes.requested() == "gemm" and routes.backward_route(dense(64)).name == "gemm"
    assert routes.requested() == "ffpa"
    with pytest.raises(ValueError, match="expected one of"):
        with routes.forced("nope"):
            pass


@pytest.mark.parametrize("problem, names", [
    (dense(64), {"fused", "gemm"}),
    (dense(64, family="fa4", d=128), {"fused"}),
    (packed([64, 64]), {"fused", "gemm-dense", "gemm-segments", "gemm-groups", "gemm-groups+fused"}),
    (packed([64, 30], [64, 31]), {"fused", "gemm-groups", "gemm-groups+fused"}),
    (traced(2, 64, 64, 128, 128), {"fused", "gemm-padded", "gemm-segments", "gemm-segments|fused"}),
    (traced(2, 64, 64, 128, 140, same=False), {"fused", "gemm-padded"}),
])
def test_serving_routes(problem, names):
    """What the contract fuzz forces: every route that can serve the problem, and each can be forced."""
    assert set(routes.serving_routes(problem)) == names
    for name in names:
        assert routes.backward_route(problem, name).name == name


def test_a_forward_never_reads_the_backward_knobs(monkeypatch):
    monkeypatch.setenv("XATTN_BWD_ROUTE", "fastest")
    monkeypatch.setenv("XATTN_GEMM_BWD_BUDGET_MIB", "lots")
    assert routes.forward_route(routes.FwdProblem("ffpa", 1, 4, 8, 2048, 2048)).name == "fused"
    assert routes.requested() == "fastest" and gemm_bwd_plan.budget_setting() == "lots"  # read raw, unvalidated


def test_info_lists_the_route_table(monkeypatch):
    lines = routes.route_table()
    assert any("GQA group >= 8" in x for x in lines) and any("XATTN_BWD_ROUTE" in x for x in lines)
    monkeypatch.setenv("XATTN_BWD_ROUTE", "fastest")
    with pytest.raises(ValueError, match="fastest"):
        routes.route_table()


def test_short_groups_split_off_under_auto():
    """Route gemm-groups+fused: groups padded under the table's key count leave the GEMMs (their documents,
    sorted); the memory bound then counts the fused call's sub-batch."""
    lens = [4000, 300, 0, 17, 2100, 1000, 1]
    groups = gemm_bwd_plan.varlen_groups(lens, lens, 8)
    long, short = routes.split_short_groups(groups, 8)
    assert [grp.docs for grp in long] == [(0,), (4,)] and short == (1, 3, 5, 6)
    assert routes.split_short_groups(groups, 1)[1] == (0, 1, 3, 4, 5, 6)  # no GQA: GEMMs from 8192 keys
    many_q, many_k = [2048] + [100] * 500, [2048] + [101] * 500  # not self-attention: the grouped layout
    auto, forced = (routes.varlen_workspace_bytes(many_q, many_k, 8, 1, 512, True, route=r) for r in ("auto", "gemm"))
    assert auto < forced  # the short documents cost less memory on the fused kernel, too


@pytest.mark.parametrize("lens_q, lens_k, layout", [
    ([3000, 100, 5000, 17], None, "segments"),   # a mix of lengths: several groups
    ([2048] * 4, None, "dense"),                 # equal documents: views of one dense batch
    ([0, 2048, 0, 2048], None, "dense"),         # empty documents take no rows
    ([300, 300], [500, 500], "dense"),           # equal per side
    ([2048, 2000, 1990], None, "groups"),        # lengths within one group's fill
    ([300, 40], [300, 50], "groups"),            # queries and keys differ (not self-attention)
    ([300, 300], [300, 0], "groups"),            # a document without keys
])
def test_packed_layout(lens_q, lens_k, layout):
    lens_k = lens_k or lens_q
    assert routes.packed_layout(lens_q, lens_k, 32) == layout
    assert (routes.equal_documents(lens_q, lens_k) is not None) == (layout == "dense")
