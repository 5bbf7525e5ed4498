"""The fuzz results: one row per front end, written at the end of the session; each row counts the backward
routes its configurations ran (``routes``: runs and failures per route name) and lists, for every packed
configuration or one with a choice of routes, ``[seed, pool entry, routes run, passed]`` (``route_runs``).

``benchmarks/results/fuzz_h200.json`` (or ``XATTN_FUZZ_OUT``)::

    {"suite": ..., "tolerance": ..., "pool_launchers": 60,
     "rows": [{"front_end": "core", "configs": 300, "passed": 300, "failed": 0,
               "worst_err_over_tol": 0.41, "worst": "s123-fa4-... dq", "failing_seeds": [],
               "seed": 20261201, "device": "NVIDIA H200", "date": "2026-12-01", "seconds": 51.2, ...}, ...]}

Rows of front ends that did not run in this session are kept from an existing file, so front ends
can run in separate processes (or device calls) and still end up in one file. With ``autosave`` the
file is rewritten after every configuration, so a run cut short by a time limit still leaves its rows
(``configs`` < ``n_requested`` shows it; ``selection`` names a ``XATTN_FUZZ_START`` / ``XATTN_FUZZ_SHARD`` part).

Parts of one front end's run (shards run side by side, a run resumed in a later device call) become one row::

    python -m tests.fuzz.results merge --out fuzz.json part1.json part2.json ...

counts, routes and route runs summed, the worst ratio kept, each part listed under ``parts``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
from pathlib import Path

from .space import ALL_FRONT_ENDS, POOL, Config, selection_note
from .tolerance import K

__all__ = ["Collector", "output_path", "merge_rows", "document", "DESCRIPTIONS", "DIMENSIONS"]

ROOT = Path(__file__).resolve().parents[2]
DESCRIPTIONS = {
    "core": "xattn.core ffpa/fa4 fwd + bwd on torch buffers (drawn layouts, poisoned outputs, bwd_workspace)",
    "core-jax": "xattn.core with JAX arrays (DLPack) for q, k, v, dout, out/lse and cu_seqlens; torch outputs, "
                "some as raw tvm_ffi.Tensor views",
    "torch": "xattn.torch.attention_with_lse / xattn.torch.fa4_interface.flash_attn(_varlen)_func + torch.autograd",
    "jax": "xattn.jax ffpa_attention / flash_attention / varlen_attention under jax.vjp (eager or jit)",
    "hf": "xattn.torch.ffpa_attention.ffpa_attention_forward (HF 'ffpa'): no mask, 2D masks of any width, 4D masks, "
          "the 'ffpa' factory's masks with cache offsets and padding; + torch.autograd",
    "fa4-doc": "xattn.torch.fa4 document_causal_fa4_attention (shards, runs of 1, padding ids 0/-1/-3) and "
               "causal_fa4_attention; + torch.autograd",
    "jax-nn": "xattn.jax.dot_product_attention with is_causal, local_window_size, query/key_value_seq_lengths, "
              "T != S; under jax.vjp",
}
DIMENSIONS = [  # what the configurations vary (issue #22 widened the space: the last six lines)
    "launcher pool: every FA4 head-dim pair, FFPA 320/336/384/448/512, fp16/bf16, GQA 1-8, full/causal/windows",
    "shapes: batch, Nq != Nk (1, tiny, not a tile multiple), heads; varlen documents of length 0 and 1",
    "memory layouts: contiguous, heads-major (HF), padded head dim, slices of wider head storage",
    "window_size in every public spelling: None, ints, 0, FlashAttention-2's -1, causal with a window, "
    "right sides that causality clips",
    "refused forms (named error before any launch): FFPA windows, negative sides other than -1, non-int sides",
    "HF ffpa_attention_forward: no mask, 2D padding masks as wide as / narrower / wider than the keys, 4D bool "
    "and additive masks, the 'ffpa' factory's masks (causal, sliding, bidirectional) with cache offsets and padding",
    "NeMo FA4 helpers: document_causal_fa4_attention query shards, runs of length 1, padding ids 0 / -1 / -3; "
    "causal_fa4_attention",
    "xattn.jax.dot_product_attention: is_causal, local_window_size (int or pair), query/key_value_seq_lengths "
    "(0 and full included), T != S",
    "the CPU slice (CI) also runs xattn.jax's reference backend",
]
TOLERANCE = ("per quantity: max|x - x64| <= K * max|x_lowprec - x64| + eps(dtype) * max(max|x64|, 1), "
             f"K = {K}; x_lowprec: the same attention computed in the input dtype (tests/fuzz/tolerance.py)")


def output_path() -> Path:
    return Path(os.environ.get("XATTN_FUZZ_OUT") or ROOT / "benchmarks" / "results" / "fuzz_h200.json")


class Collector:
    """Accumulates verdicts per front end; :meth:`write` merges them into the results file."""

    def __init__(self, base_seed: int, n: int, only=None, kernels: str = "cutedsl", autosave=None):
        self.base_seed, self.n, self.only, self.kernels = base_seed, n, only, kernels
        self.autosave = autosave  # (path, device) to rewrite after every record, or None
        self.rows: dict[str, dict] = {}

    def record(self, cfg: Config, checks, error: str | None = None, seconds: float = 0.0, routes=("fused",)) -> None:
        """One configuration's verdict; ``routes``: the backward routes it ran (forced, each judged)."""
        row = self.rows.setdefault(cfg.front_end, dict(configs=0, passed=0, failed=0, worst_err_over_tol=0.0,
                                                        worst="", failing_seeds=[], errors={}, seconds=0.0,
                                                        routes={}, route_runs=[]))
        row["configs"] += 1
        for name in routes:  # how often each route ran, and where it failed (a check named "<q>@<route>")
            count = row["routes"].setdefault(name, {"runs": 0, "failed": 0})
            count["runs"] += 1
            bad = error is not None or any(not c.ok and (c.name.endswith("@" + name) or "@" not in c.name)
                                           for c in checks)
            count["failed"] += bad
        if len(routes) > 1 or getattr(cfg, "varlen", False):  # each row with a choice: [seed, entry, routes, ok]
            row["route_runs"].append([cfg.seed, cfg.id, list(routes),
                                      error is None and all(c.ok for c in checks)])
        row["seconds"] += seconds
        ok = error is None and all(c.ok for c in checks)
        row["passed" if ok else "failed"] += 1
        if not ok:
            row["failing_seeds"].append(cfg.seed)
        if error is not None:
            row["errors"][str(cfg.seed)] = error[:300]
        for c in checks:
            ratio = c.ratio if not c.problems else math.inf
            if ratio > row["worst_err_over_tol"]:
                row["worst_err_over_tol"] = ratio
                row["worst"] = f"{cfg.id} {c!r}"
        if self.autosave is not None:
            self.write(*self.autosave)

    def table(self, device: str, date: str | None = None) -> list[dict]:
        date = date or datetime.date.today().isoformat()
        out = []
        for front_end, row in self.rows.items():
            worst = row["worst_err_over_tol"]
            out.append({"front_end": front_end, "configs": row["configs"], "passed": row["passed"],
                        "failed": row["failed"],
                        "worst_err_over_tol": round(worst, 4) if math.isfinite(worst) else "inf",
                        "worst": row["worst"], "failing_seeds": sorted(row["failing_seeds"]),
                        "errors": row["errors"], "seed": self.base_seed, "n_requested": self.n,
                        "only": self.only, "device": device, "date": date, "seconds": round(row["seconds"], 1),
                        "kernels": self.kernels, "what": DESCRIPTIONS.get(front_end, ""),
                        "routes": row.get("routes", {}), "route_runs": row.get("route_runs", [])})
            note = selection_note(self.n) if self.only is None else ""
            if note:
                out[-1]["selection"] = note
        return out

    def write(self, path, device: str, date: str | None = None) -> dict:
        """Write (merge) the rows of this session into ``path``; returns the document written."""
        path = Path(path)
        new = self.table(device, date)
        kept = []
        if path.exists():
            try:
                kept = [r for r in json.loads(path.read_text()).get("rows", [])
                        if r.get("front_end") not in self.rows]
            except (ValueError, AttributeError):
                kept = []
        doc = document(kept + new)
        _write_json(path, doc)
        return doc


def document(rows: list[dict]) -> dict:
    """The results file's document around ``rows`` (ordered by front end)."""
    order = {fe: i for i, fe in enumerate(ALL_FRONT_ENDS)}
    rows = sorted(rows, key=lambda r: order.get(r.get("front_end"), 9))
    return {"suite": "pytest -m fuzz tests/fuzz (random configurations vs fp64, forward and backward)",
            "tolerance": TOLERANCE, "pool_launchers": 2 * len(POOL), "dimensions": DIMENSIONS, "rows": rows}


def _write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


_SAME = ("front_end", "seed", "n_requested", "kernels", "only")  # the parts of one run agree on these


def _parts(row: dict) -> list[dict]:
    """A row's own ``parts`` (a row merged before), else the row as one part."""
    if "parts" in row:
        return list(row["parts"])
    return [{"selection": row.get("selection") or row.get("note") or "all", "configs": row["configs"],
             "device": row["device"], "date": row["date"], "seconds": row["seconds"]}]


def merge_rows(rows: list[dict]) -> dict:
    """One row from the rows of parts of one front end's run (same front end, seed, count, kernels): counts,
    seconds and route tallies summed, failing seeds and errors united, the worst ratio kept; ``parts`` lists
    each part's selection (or note), configurations, device and date. Raises ValueError when the parts
    disagree or together hold more configurations than the run asked for."""
    if not rows:
        raise ValueError("merge_rows: no rows")
    first = rows[0]
    for r in rows[1:]:
        diff = [k for k in _SAME if r.get(k) != first.get(k)]
        if diff:
            raise ValueError(f"merge_rows: parts differ in {diff}: {[r.get(k) for k in diff]} vs "
                             f"{[first.get(k) for k in diff]}")
    total = sum(r["configs"] for r in rows)
    if first.get("only") is None and total > first["n_requested"]:
        raise ValueError(f"merge_rows: {total} configurations in the parts, the run asked for {first['n_requested']}"
                         " (a part merged twice?)")
    seen: set[int] = set()
    for r in rows:  # the configurations with a choice of routes name their seeds: none may be in two parts
        seeds = {run[0] for run in r.get("route_runs", [])}
        if seeds & seen:
            raise ValueError(f"merge_rows: seeds {sorted(seeds & seen)[:5]} are in two parts (a part merged twice?)")
        seen |= seeds
    worst = max(rows, key=lambda r: math.inf if r["worst_err_over_tol"] == "inf" else r["worst_err_over_tol"])
    routes: dict[str, dict] = {}
    for r in rows:
        for name, count in r.get("routes", {}).items():
            acc = routes.setdefault(name, {"runs": 0, "failed": 0})
            acc["runs"] += count["runs"]
            acc["failed"] += count["failed"]
    devices = sorted({r["device"] for r in rows})
    out = dict(first, configs=total, passed=sum(r["passed"] for r in rows), failed=sum(r["failed"] for r in rows),
               worst_err_over_tol=worst["worst_err_over_tol"], worst=worst["worst"],
               failing_seeds=sorted(s for r in rows for s in r["failing_seeds"]),
               errors={k: v for r in rows for k, v in r.get("errors", {}).items()},
               device=" + ".join(devices), date=max(r["date"] for r in rows),
               seconds=round(sum(r["seconds"] for r in rows), 1), routes=routes,
               route_runs=[x for r in rows for x in r.get("route_runs", [])],
               parts=[part for r in rows for part in _parts(r)])
    out.pop("selection", None)
    out.pop("note", None)
    return out


def _merge_main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz.results merge",
                                 description="Merge fuzz results files; the rows of one front end become one row.")
    ap.add_argument("--out", required=True, type=Path, help="the merged results file (overwritten)")
    ap.add_argument("--note", default=None, help="a note for every merged row")
    ap.add_argument("inputs", nargs="+", type=Path)
    args = ap.parse_args(argv)
    by_front_end: dict[str, list[dict]] = {}
    for path in args.inputs:
        for row in json.loads(path.read_text()).get("rows", []):
            by_front_end.setdefault(row["front_end"], []).append(row)
    rows = []
    for front_end, parts in by_front_end.items():
        row = merge_rows(parts) if len(parts) > 1 else parts[0]
        if args.note and len(parts) > 1:
            row["note"] = args.note
        rows.append(row)
        print(f"{front_end}: {row['configs']} configurations in {len(parts)} part(s), {row['passed']} passed, "
              f"{row['failed']} failed, worst err/tol {row['worst_err_over_tol']}")
    _write_json(args.out, document(rows))


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["merge"]:
        sys.exit("usage: python -m tests.fuzz.results merge --out OUT IN [IN ...]")
    _merge_main(sys.argv[2:])
