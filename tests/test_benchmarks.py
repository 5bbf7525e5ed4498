"""The benchmark tooling that runs without a GPU: the full plan, the report (ratios, peak share,
markdown) and the plot when matplotlib is there."""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name, folder="benchmarks"):
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_full_plan_covers_the_issue():
    full = _load("full")
    d512 = full.plan("d512")
    assert {r[0] for r in d512} >= {"xattn.torch", "xattn.jax", "ffpa_attn native", "torch sdpa", "jax xla",
                                    "jax cudnn"}
    assert {r[4] for r in d512} == {1024, 2048, 4096, 8192, 16384, 32768}
    assert {(r[2], r[3]) for r in d512} == {(32, 4), (16, 16)}
    assert {r[1] for r in full.plan("small")} == {128, 256}
    assert full.flops(1, 1, 4, 4, 1, True, "fwd") == 4 * 8 and full.flops(1, 1, 4, 4, 1, False,
                                                                          "fwd+bwd") == 4 * 16 * 3.5
    assert full.flops(1, 1, 4, 4, 1, False, "fwd", window=2) == 4 * (1 + 2 + 2 + 2)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "full.py"), "--part", "sliding", "--dry-run"],
                         capture_output=True, text=True, check=True).stdout
    assert "5 rows in part sliding" in out and "matmul" in out  # + the same-run peak


def _rows():
    base = dict(head_dim=512, heads_q=32, heads_kv=4, causal=True, dtype="bfloat16", device="H200", status="ok",
                part="d512")
    rows = [dict(base, method="torch bf16 matmul 8192^3", head_dim=0, seqlen=8192, **{"pass": "matmul"}, ms=1.0,
                 tflops=800.0)]
    for n, nat, ours in ((4096, 380.0, 386.0), (8192, 480.0, 490.0)):
        rows.append(dict(base, method="ffpa_attn native", seqlen=n, **{"pass": "fwd"}, ms=1.0, tflops=nat))
        rows.append(dict(base, method="xattn.torch", seqlen=n, **{"pass": "fwd"}, ms=1.0, tflops=ours))
    rows.append(dict(base, method="jax cudnn", seqlen=4096, **{"pass": "fwd"}, ms=None, tflops=None,
                     status="refused: head_dim 512"))
    return rows


def test_report_ratios_peak_and_markdown(tmp_path):
    report = _load("report")
    rows = report.enrich(_rows())
    ours = [r for r in rows if r["method"] == "xattn.torch"]
    assert [r["vs_native"] for r in ours] == [round(386 / 380, 3), round(490 / 480, 3)]
    assert ours[0]["pct_peak"] == round(100 * 386 / 800, 1)
    md = report.markdown(rows)
    assert "| jax cudnn | 512 | 32/4 | 4096 | True | fwd |  |  |  |  |  | refused: head_dim 512 |" in md
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(_rows()))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), str(path)], check=True, capture_output=True)
    md = (tmp_path / "rows.md").read_text()
    assert md.startswith("## Targets") and "\n| method |" in md


def test_report_targets_list_every_row_below():
    report = _load("report")
    rows = _rows() + [dict(_rows()[1], method="xattn.jax", tflops=370.0),  # 370 / 380 < 0.98
                      dict(_rows()[3], method="xattn.jax", tflops=475.0)]  # 475 / 480 >= 0.98
    md = report.targets(report.enrich(rows))
    assert "| xattn.torch >= 98 % of ffpa_attn native (d512, N >= 4k) | 2 | none |" in md
    assert "| xattn.jax >= 98 % of ffpa_attn native (d512, N >= 4k) | 2 | d512 32/4 N4096 causal fwd 0.974 |" in md
    assert "| xattn.torch | 32/4 | fwd | 8192 |" in md and "matmul |" not in md.split("Longest")[1]


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    report = _load("report")
    report.plot(report.enrich(_rows()), str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_e2e_gemma4_jax_model_xattn_equals_xla_on_the_reference_path():
    """The JAX e2e model wires xattn exactly like jax.nn (window, causal, GQA, k == v): fp32, CPU, on the
    reference backend by name (fp32 and these small head dims are not kernel configurations)."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("flax.nnx")
    from benchmarks.e2e_gemma4 import build_jax_step

    dims = dict(hidden=64, mlp=128, heads=4, sliding_kv=2, sliding_d=32, window=8, full_kv=1, full_d=64, layers=6)
    with jax.default_matmul_precision("highest"):
        got = {}
        for impl in ("xattn", "xla", "none"):
            step, params, ids, labels = build_jax_step(impl, 40, dims, vocab=100, dtype="float32", backend="reference")
            got[impl] = step(params, ids, labels)
    (loss_x, grads_x), (loss_r, grads_r), (loss_0, _) = got["xattn"], got["xla"], got["none"]
    assert abs(float(loss_x) - float(loss_r)) < 1e-5 * abs(float(loss_r))
    assert abs(float(loss_0) - float(loss_r)) > 1e-3  # attention matters: the stand-in changes the loss
    for a, b in zip(jax.tree.leaves(grads_x), jax.tree.leaves(grads_r)):
        assert float(abs(a - b).max()) <= 1e-4 * float(abs(b).max()) + 1e-12


def test_e2e_gemma4_derive_speedup_and_attention_share():
    from benchmarks.e2e_gemma4 import derive, table

    rows = [dict(framework="torch", impl=i, seqlen=8192, status="ok", step_s=s, tokens_per_s=1, peak_gib=1.0)
            for i, s in (("ffpa", 0.4), ("sdpa", 0.6), ("none", 0.3))]
    rows.append(dict(framework="torch", impl="sdpa", seqlen=32768, status="oom"))
    rows = derive(rows)
    assert rows[0]["speedup_vs_sdpa"] == 1.5 and rows[0]["attn_share"] == 0.25
    assert rows[2]["attn_share"] is None
    assert "oom" in table(rows)


def test_e2e_gemma4_error_rows_name_the_failure_not_a_source_line():
    from benchmarks.e2e_gemma4 import _error_line

    tb = ('Traceback (most recent call last):\n  File "m.py", line 3\n    return rms(x)\n'
          'jax.errors.JaxRuntimeError: INTERNAL: failed to launch\n----\n'
          'For simplicity, JAX removed frames\n    return rms(x)\n')
    assert _error_line(tb) == "jax.errors.JaxRuntimeError: INTERNAL: failed to launch"
    assert _error_line("F1201 10:00:00 gpu.cc:12] Check failed: ok\n    at frame\n").startswith("F1201")
    assert _error_line("no error line\n") == "no error line" and _error_line("") == "?"


def test_e2e_gemma4_refuses_an_impl_of_the_other_framework_before_running(tmp_path):
    from benchmarks.e2e_gemma4 import main

    out = tmp_path / "rows.json"
    with pytest.raises(SystemExit):  # argparse's error: nothing measured, no error rows written
        main(["--parts", "torch,jax", "--packed", "--impls", "ffpa,none", "--out", str(out)])
    assert not out.exists()


def test_aliased_probe_entries_hold_each_document_at_its_first_token():
    entry_offsets = _load("aliased_varlen_gemm_probe", "benchmarks/tools").entry_offsets

    lens = [3, 0, 2, 1, 4]
    cu = entry_offsets(lens)
    starts = np.concatenate([[0], np.cumsum(lens)])
    assert cu.dtype == np.int32 and cu.shape == (sum(lens) + 1,) and cu[0] == 0 and cu[-1] == sum(lens)
    rows = {t: (int(a), int(b)) for t, (a, b) in enumerate(zip(cu[:-1], cu[1:])) if b > a}
    assert rows == {int(s): (int(s), int(s) + n) for s, n in zip(starts[:-1], lens) if n}


def test_aliased_probe_block_entries_pack_block_c_rows_at_each_document_start():
    block_entries = _load("aliased_varlen_gemm_probe", "benchmarks/tools").block_entries

    lens = [5, 0, 2, 9, 4]  # rows 4: block 1 holds rows 4.. of the documents longer than 4
    cu, a_off = block_entries(lens, rows=4, block=1)
    starts = np.concatenate([[0], np.cumsum(lens)])
    assert cu.shape == (sum(lens) + 1,) and a_off.shape == (sum(lens),)
    entries = {t: (int(a), int(b), int(a_off[t])) for t, (a, b) in enumerate(zip(cu[:-1], cu[1:])) if b > a}
    # document 0 (5 rows): row 4; document 3 (9 rows): rows 4-7; packed from 0 in document order
    assert entries == {int(starts[0]): (0, 1, 4), int(starts[3]): (1, 5, int(starts[3]) + 4)}
    assert int(cu[-1]) == 5


def test_aliased_probe_block_pieces_address_rows_scratch_and_aligned_keys():
    block_pieces = _load("aliased_varlen_gemm_probe", "benchmarks/tools").block_pieces

    lens = [5, 0, 2, 9, 4]
    pc = block_pieces(lens, rows=4, block=1, align=4)  # documents 0 (row 4) and 3 (rows 4-7) have block 1
    assert pc["docs"] == [0, 3]
    assert pc["cu_k"].tolist() == [0, 1, 5]  # their rows packed in the scratch
    assert pc["b_off"].tolist() == [4, 7 + 4]  # first q row of each piece: document start + 4
    assert pc["d_off"].tolist() == [0, 8 + 0 + 4]  # accumulator starts: 0, then 8 (5 -> 8), 0, 4 (2 -> 4)
    assert pc["keys"].tolist() == [5, 8] and pc["cu_keys"].tolist() == [0, 5, 13]  # min(kend 8, L)
    assert pc["acc_rows"] == 8 + 0 + 4 + 12 + 4
    for d, k, n in zip(pc["d_off"], pc["keys"], (5, 9)):  # no piece writes into the next document's rows
        assert d + k <= d + -(-n // 4) * 4


@pytest.mark.compile
def test_aliased_probe_launchers_compile_with_their_managers_in_place_of_quacks():
    probe = _load("aliased_varlen_gemm_probe", "benchmarks/tools")
    import quack.gemm_sm90 as sm90
    from quack.varlen_utils import VarlenManager

    used = []
    make = probe.table_manager_class

    def recording():
        cls = make()
        offset_a = cls.offset_batch_A

        def offset_batch_A(self, *args):
            used.append(type(self).__name__)
            return offset_a(self, *args)

        cls.offset_batch_A = offset_batch_A
        return cls

    probe.table_manager_class = recording
    probe.compile_table_mm()
    assert used and set(used) == {"TableManager"}  # the traced kernel took A's offsets from the table
    assert sm90.VarlenManager is VarlenManager  # and quack's own manager is back

    make_keys, make_gemm = probe.keys_manager_class, probe.keys_gemm_class
    seen = []

    def recording_keys():
        cls = make_keys()
        offset_b, offset_epi = cls.offset_batch_B, cls.offset_batch_epi
        cls.offset_batch_B = lambda self, *a: seen.append("B") or offset_b(self, *a)
        cls.offset_batch_epi = lambda self, *a: seen.append("D") or offset_epi(self, *a)
        return cls

    def recording_gemm():
        cls = make_gemm()
        scheduler = cls.get_scheduler_class
        cls.get_scheduler_class = lambda self, *a, **k: seen.append("scheduler") or scheduler(self, *a, **k)
        return cls

    probe.keys_manager_class, probe.keys_gemm_class = recording_keys, recording_gemm
    probe.compile_keys_mm()
    assert {"B", "D", "scheduler"} <= set(seen) and sm90.VarlenManager is VarlenManager

    make_dq, stores = probe.dq_manager_class, []

    def recording_dq():
        cls = make_dq()
        offset_epi = cls.offset_batch_epi
        cls.offset_batch_epi = lambda self, *a: stores.append(type(self).__name__) or offset_epi(self, *a)
        return cls

    probe.dq_manager_class = recording_dq
    probe.compile_dq_mm()
    assert stores and set(stores) == {"DqManager"} and sm90.VarlenManager is VarlenManager


def test_bwd_routes_tables_pair_the_routes():
    from benchmarks.bwd_routes import markdown, markdown_jax

    base = dict(heads_q=32, heads_kv=4, causal=True, seqlen=8192, dtype="bfloat16", target_fwd_bwd_tflops=400)
    rows = [dict(base, method="xattn.torch", route=r, **{"pass": p, "tflops": t, "extra_gib": 3.2})
            for r, p, t in (("ffpa", "bwd", 230.0), ("gemm", "bwd", 370.0), ("ffpa", "fwd+bwd", 275.0),
                            ("gemm", "fwd+bwd", 404.8))]
    rows += [dict(base, method="xattn.jax", route=r, **{"pass": "fwd+bwd", "tflops": t})
             for r, t in (("ffpa", 283.5), ("gemm", 441.8))]
    torch_table, jax_table = markdown(rows), markdown_jax(rows)
    assert "| Hq32/Hkv4 causal | 8192 | bfloat16 | 230.0 | 370.0 | 275.0 | **404.8** | >= 400 | 3.2 |" in torch_table
    assert "| Hq32/Hkv4 causal | 8192 | bfloat16 | 283.5 | **441.8** | >= 400 |" in jax_table


def test_packed_rows_and_table():
    packed = _load("packed")
    assert packed.documents("2048") == [2048] * 8 and packed.documents("16384") == [16384]
    mix = packed.documents("mix64k")
    assert sum(mix) == 65536 and all(1 <= n <= 8192 for n in mix) and len(set(mix)) > 10
    assert mix == packed.documents("mix64k")  # seeded
    with pytest.raises(ValueError, match="must divide"):
        packed.documents("3000")
    assert packed.causal_flops([2, 2]) == 2 * 4 * 32 * 4 * 512 * 0.5 * 3.5
    r = packed.row("torch", "mix16k", [3, 5], 1e12, 2.0, 4.0, 1.8, "H200")
    assert r["doc_len"] == "mix" and r["varlen_tflops"] == 500.0 and r["ratio"] == 0.9
    assert "| torch | mix of 2 | 8 | **500.0** | 250.0 | 555.6 | 0.90 |" in packed.markdown([r])


def test_decode_rows_table_and_a_cpu_run(monkeypatch):
    """benchmarks/decode.py: tokens compared with sdpa's eager row, the table, and one real (CPU, tiny model)
    prefill + greedy decode through generate(), timed by the same code as on the GPU (the compiled mode's
    path is tested in tests/torch/test_decode_graphs.py)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT))
    decode = _load("decode")
    rows = decode.derive([dict(impl="sdpa", mode="eager", prompt_len=8, status="ok", tokens=[1, 2, 3]),
                          dict(impl="ffpa", mode="graphs", prompt_len=8, status="ok", tokens=[1, 2, 4],
                               ms_per_token=4.1, prefill_s=0.1),
                          dict(impl="flash_attention_2", mode="eager", prompt_len=8, status="error: ImportError")])
    assert rows[1]["tokens_equal_sdpa"] == round(2 / 3, 3) and "tokens_equal_sdpa" not in rows[2]
    assert "| ffpa | graphs | 8 | 4.10 | 0.100 | 67% |" in decode.table(rows[1:])
    from tests.torch.gemma import tiny_gemma4_config

    monkeypatch.setattr(decode, "DEVICE", "cpu")
    net = decode.build_model("sdpa", tiny_gemma4_config(hidden=64, layers=2, vocab=64, sliding_window=4))
    got = decode.Decoder(net, "eager", 12, 4).run(repeats=2)
    # a difference of two wall times on a tiny CPU model: its sign is noise (CI saw -10.7), only its form is checked
    assert len(got["tokens"]) == 4 and math.isfinite(got["ms_per_token"]) and got["prefill_s"] > 0
    assert len(got["ms_per_token_runs"]) == 2


def test_decode_rounds_combine_to_their_median():
    decode = _load("decode")
    rounds = [dict(impl="ffpa", mode="eager", status="ok", ms_per_token=t, prefill_s=p)
              for t, p in ((9.0, 0.2), (14.0, 0.1), (10.0, 0.3))]
    row = decode.combine(rounds)
    assert row["ms_per_token"] == 10.0 and row["prefill_s"] == 0.2 and row["ms_per_token_rounds"] == [9.0, 14.0, 10.0]
    failed = dict(impl="ffpa", mode="eager", status="error: timeout after 300 s")
    assert decode.combine(rounds[:1]) == rounds[0] and decode.combine([rounds[0], failed]) == failed
    with pytest.raises(SystemExit):  # --repeats 0 would time nothing
        decode.main(["--repeats", "0"])


def test_run_child_reports_result_error_and_timeout():
    run_child = _load("e2e_gemma4").run_child
    py = [sys.executable, "-c"]
    assert run_child(py + ['print("x"); print("RESULT {\\"a\\": 1}")'], 60) == ({"a": 1}, "ok")
    got, status = run_child(py + ["raise KeyError('no such row')"], 60)
    assert got is None and status == "error: KeyError: 'no such row'"
    assert run_child(py + ["import time; time.sleep(5)"], 0.5) == (None, "error: timeout after 0 s")


def test_host_cost_rows_keep_the_best_of_their_runs():
    merge = _load("tools/host_cost").merge  # a GPU tool: its merge of repeated runs, on the CPU
    row = lambda label, us, call="c": dict(label=label, commit="abc", front_end="torch", call=call,  # noqa: E731
                                           us_per_call=us)
    first = merge([], [row("after", 30.0), row("before", 40.0)])
    got = merge(first, [row("after", 25.0), row("after", 9.0, call="other")])
    by = {(r["label"], r["call"]): r for r in got}
    assert by["after", "c"]["us_per_call"] == 25.0 and by["after", "c"]["runs"] == [30.0, 25.0]
    assert by["before", "c"]["us_per_call"] == 40.0 and by["after", "other"]["runs"] == [9.0]
    assert merge(got, [row("after", 50.0)])[-1]["us_per_call"] == 25.0  # a slower run does not replace it


def test_host_cost_cpu_tool_runs():
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tools" / "host_cost_cpu.py")], capture_output=True,
                         text=True, check=True, timeout=300).stdout
    assert out.count(" us  ") == 7 and "ffpa_attention_forward, d512 decode" in out and "(split-kv)" in out


@pytest.mark.slow  # ~50 s of CPU: transformers' continuous batching loop, twice
def test_continuous_batching_rows_and_a_cpu_run(monkeypatch):
    """benchmarks/continuous_batching.py on the CPU with a tiny Gemma 4 whose global layers have their own head dim
    and KV heads (as the 31B's): transformers' allocator sized per group (the benchmark's patch, undone after),
    both impls, rows with throughput and the tokens compared."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT))
    cb = _load("continuous_batching")
    monkeypatch.setattr(cb, "DEVICE", "cpu")
    from transformers import Gemma4TextConfig
    from transformers.generation.continuous_batching.cache_allocators import full_attention

    before = full_attention.FullAttentionCacheAllocator.__init__
    tiny = lambda: Gemma4TextConfig(  # noqa: E731
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=256,
        vocab_size_per_layer_input=64, hidden_size_per_layer_input=16)
    rows = []
    for impl in ("ffpa", "sdpa"):  # one config object per model (from_config writes into it)
        rows += cb.main(["--impls", impl, "--requests", "2,3", "--prompt", "12", "--tokens", "3"], config=tiny())
    assert full_attention.FullAttentionCacheAllocator.__init__ is before
    assert [(r["impl"], r["requests"], r["status"]) for r in rows] == [
        ("ffpa", 2, "ok"), ("ffpa", 3, "ok"), ("sdpa", 2, "ok"), ("sdpa", 3, "ok")], rows
    assert all(r["tokens_per_s"] > 0 and len(r["tokens"]) == r["requests"] for r in rows)
