"""Turn benchmark JSON rows into the markdown table and the PNG plot (runs anywhere).

    python benchmarks/report.py benchmarks/results/full_h200.json [--png benchmarks/results/full_h200.png]

Adds, per row, the ratio to the native kernel of the same shape and pass (``vs_native``) and
the share of the measured bf16 matmul peak (``pct_peak``, from the ``matmul`` row if present).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

NATIVE = {512: "ffpa_attn native", 128: "flash_attn.cute native", 256: "flash_attn.cute native"}


def _key(r):  # rows of one part are one run: ratios never mix runs
    return (r.get("part"), r["head_dim"], r["heads_q"], r["heads_kv"], r["seqlen"], str(r["causal"]), r["pass"])


def enrich(rows: list[dict]) -> list[dict]:
    """Add ``vs_native`` and ``pct_peak`` where they apply (returns new dicts)."""
    peaks = [r["tflops"] for r in rows if r["pass"] == "matmul" and r.get("tflops")]
    peak = max(peaks) if peaks else None  # every part measures it; the best run is the card's peak
    native = {_key(r): r for r in rows if r["method"] == NATIVE.get(r["head_dim"]) and r.get("tflops")}
    out = []
    for r in rows:
        r = dict(r)
        nat = native.get(_key(r))
        if r.get("tflops") and nat and r is not nat:
            r["vs_native"] = round(r["tflops"] / nat["tflops"], 3)
        if r.get("tflops") and peak and r["pass"] != "matmul":
            r["pct_peak"] = round(100 * r["tflops"] / peak, 1)
        out.append(r)
    return out


def _ratio_check(rows, method, other, want, where=lambda r: True):
    """``(rows compared, [(row, ratio) below want])`` for ``method / other`` on the same key."""
    by_key = {_key(r): r for r in rows if r["method"] == other and r.get("tflops")}
    n, below = 0, []
    for r in rows:
        o = by_key.get(_key(r)) if r["method"] == method and r.get("tflops") and where(r) else None
        if o is None:
            continue
        n += 1
        ratio = r["tflops"] / o["tflops"]
        if ratio < want:
            below.append((r, ratio))
    return n, below


def targets(rows: list[dict]) -> str:
    """The #6 targets, checked from the rows: a markdown section, every row below target listed."""
    def name(r):
        return (f"{'fp16 ' if r.get('dtype') == 'float16' else ''}d{r['head_dim']} {r['heads_q']}/{r['heads_kv']} "
                f"N{r['seqlen']} {'causal ' if r['causal'] is True else ''}{r['pass']}")

    lines = ["## Targets, checked from these rows", "", "| target | rows | below target |", "|---|---|---|"]
    checks = []
    timed_parts = ("d512", "small", "fp16")  # the parts with native rows of the same run
    for fw in ("xattn.torch", "xattn.jax"):
        for d in (512, 128, 256):
            checks.append((f"{fw} >= 98 % of {NATIVE[d]} (d{d}, N >= 4k)", fw, NATIVE[d], 0.98,
                           lambda r, d=d: r["head_dim"] == d and r["seqlen"] >= 4096 and r.get("part") in timed_parts))
    checks.append(("d512: xattn.torch >= 3x torch sdpa (N >= 4k)", "xattn.torch", "torch sdpa", 3.0,
                   lambda r: r["head_dim"] == 512 and r["seqlen"] >= 4096 and r.get("part") in ("d512", "fp16")))
    for p in ("fwd", "fwd+bwd"):
        checks.append((f"d512 causal {p}: xattn.jax >= 2.5x jax xla", "xattn.jax", "jax xla", 2.5,
                       lambda r, p=p: r["head_dim"] == 512 and r["causal"] is True and r["pass"] == p
                       and r.get("part") == "d512"))
    for label, method, other, want, where in checks:
        n, below = _ratio_check(rows, method, other, want, where)
        listed = ", ".join(f"{name(r)} {ratio:.3f}" for r, ratio in below) or "none"
        lines.append(f"| {label} | {n} | {listed} |")
    longest = defaultdict(int)
    for r in rows:
        if r.get("part") == "d512" and r.get("tflops") and r["pass"] != "matmul":
            k = (r["method"], f"{r['heads_q']}/{r['heads_kv']}", r["pass"])
            longest[k] = max(longest[k], r["seqlen"])
    lines += ["", "Longest N that ran (d512; the plan stops at 32k):", "",
              "| method | Hq/Hkv | pass | longest N |", "|---|---|---|---|"]
    lines += [f"| {m} | {h} | {p} | {n} |" for (m, h, p), n in sorted(longest.items())]
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    head = "| method | d | Hq/Hkv | N | causal | pass | ms | TFLOP/s | vs native | % peak | us/call | status |"
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append("| " + " | ".join(str(x) for x in (
            r["method"], r["head_dim"], f"{r['heads_q']}/{r['heads_kv']}", r["seqlen"], r["causal"], r["pass"],
            r.get("ms") if r.get("ms") is not None else "", r.get("tflops") if r.get("tflops") is not None else "",
            r.get("vs_native", ""), r.get("pct_peak", ""), r.get("us_per_call", ""), r.get("status", "ok"))) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """TFLOP/s vs N per method, one panel per (head_dim, heads, causal, pass) group with >1 N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("tflops") and r["pass"] != "matmul" and not r.get("varlen") and r.get("part") not in ("hf", "fp16"):
            g = (r["head_dim"], r["heads_q"], r["heads_kv"], str(r["causal"]), r["pass"])
            groups[g][r["method"]].append((r["seqlen"], r["tflops"]))
    groups = {g: m for g, m in groups.items() if len({n for pts in m.values() for n, _ in pts}) > 1}
    if not groups:
        raise ValueError("nothing to plot: no group has more than one sequence length")
    # one colour per method across every panel, one legend for the figure (xattn in warm colours)
    names = sorted({m for methods in groups.values() for m in methods}, key=lambda m: (not m.startswith("xattn"), m))
    colours = dict(zip(names, plt.get_cmap("tab10").colors))
    cols = min(4, len(groups))
    rows_n = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.5 * cols, 3.4 * rows_n), squeeze=False)
    for ax, (g, methods) in zip(axes.flat, sorted(groups.items())):
        for method, pts in sorted(methods.items()):
            pts.sort()
            ax.plot([n for n, _ in pts], [t for _, t in pts], marker="o", label=method, color=colours[method],
                    linewidth=2.2 if method.startswith("xattn") else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d{g[0]} {g[1]}/{g[2]} causal={g[3]} {g[4]}", fontsize=9)
        ax.set_xlabel("N")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=colours[m], marker="o", label=m) for m in names]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(names), 5), fontsize=9)
    fig.suptitle(f"{rows[0].get('device', '')}: TFLOP/s vs N (bf16; causal counts half)", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    with open(args.json) as f:
        rows = enrich(json.load(f))
    md = targets(rows) + "\n\n## All rows\n\n" + markdown(rows)
    with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print(md)
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
