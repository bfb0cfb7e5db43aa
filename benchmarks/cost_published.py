"""`python -m benchmarks.cost_published`: the cost model against published step times, written into
RESULTS.md's "published" section (`--no-write`: print only). No GPU needed: the rows are
`mini3d.cost.published` (each with its source, layout and conversion), the predictions
`mini3d.cost.model.estimate_cost`; tests/test_cost_published.py checks the same bounds."""

from __future__ import annotations

import argparse
import os

from benchmarks.common import replace_section
from mini3d.cost.hardware import H100_EFF_MAX
from mini3d.cost.flops import FLOPS_CONVENTION
from mini3d.cost.model import CALIBRATED
from mini3d.cost.published import published_errors, published_rows

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def _layout(p) -> str:
    parts = [f"tp{p.tp} pp{p.pp} dp{p.dp}", p.schedule + (f" v{p.virtual_stages}" if p.virtual_stages > 1 else "")]
    parts += [f"ZeRO-{p.zero}"] if p.zero else []
    parts += [f"recompute {p.recompute}"] + (["sp"] if p.sequence_parallel else [])
    parts += [p.attention] if p.attention != "explicit" else []
    return ", ".join(parts)


NOTES = """Where it misses: Megatron-LM's 1.7B and 3.6B rows (-13%, -9%) are the smallest hidden
sizes (h=2304, 3072 at tp 1-2). The model now charges the elementwise kernels' HBM traffic (norms,
residual adds, the MLP activation: `mini3d.cost.traffic.elementwise_traffic_s`), which moved
them from -15% and -12% and the tp8 rows without sequence parallelism up (18.4B +3.7% -> +8.4%:
their norms and adds run whole on every tp rank); what is left is most likely dropout (its masks
and the attention-probability dropout Megatron-LM 2021 ran, not counted) and kernel launch gaps,
which weigh most when h is small. Korthikanti's 530B and 1T rows (+12%) assume 1F1B; the table
does not give their schedule, and an interleaved one would shrink their bubble. MegaScale's rows
are not included (its model changes the block and its table does not give each row's split);
neither are torchtitan's Float8 rows.

Before this model (1 MiB buckets, every collective a flat ring, the A100 efficiency on H100s) the
same 16 rows had a mean |error| of 28.8%: torchtitan's 128-GPU row (dp=128) was predicted +312%
(4.1x too slow), its 8-GPU row -51%; Megatron's 1.7B row happened to sit at -0.1% because the flat
25 GB/s ring it charged for the gradients happened to fill that gap."""


def report() -> str:
    rows = published_rows()
    errs = published_errors(rows)
    held = [e for e in errs if not e["fit"]]
    lines = ["## Cost model against published runs (`python -m benchmarks.cost_published`)", "",
             "Seconds per step predicted by `mini3d.cost.model.estimate_cost` against the published ones "
             "(`mini3d.cost.published`: source, layout and conversion of each row; tests/test_cost_published.py "
             "checks the bounds). Error = predicted / published - 1. Fitted constants: A100 "
             f"eff_max {CALIBRATED.eff_max}, half width {CALIBRATED.half_width} (the two Korthikanti rows "
             f"marked fit); H100 eff_max {H100_EFF_MAX} (the torchtitan 8-GPU row). MFU counts the "
             f"{FLOPS_CONVENTION}.", "",
             "| row | source | hardware | layout | GPUs | batch x seq | published s | predicted s | error | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r, e in zip(rows, errs):
        p = r["plan"]
        lines.append(f"| {r['name']}{' (fit)' if r['fit'] else ''} | {r['source']} | {r['hw'].name} | "
                     f"{_layout(p)} | {r['n_gpus']} | {p.global_batch} x {p.seq_len} | {r['published_s']:.2f} | "
                     f"{e['predicted_s']:.2f} | {e['error']:+.1%} | {e['mfu']:.1%} |")
    mean = sum(abs(e["error"]) for e in errs) / len(errs)
    lines += ["", f"Mean |error| {mean:.2%} over all {len(errs)} rows, "
              f"{sum(abs(e['error']) for e in held) / len(held):.1%} over the {len(held)} held-out rows; "
              f"worst {max(abs(e['error']) for e in errs):.1%} ({max(errs, key=lambda e: abs(e['error']))['name']}).",
              "", NOTES]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print only, leave RESULTS.md alone")
    args = ap.parse_args(argv)
    text = report()
    print(text)
    if not args.no_write:
        replace_section(RESULTS, "published", text)


if __name__ == "__main__":
    main()
