"""Turn a `mini3d train --log-jsonl FILE` log into a loss plot, as a hand-written SVG (no plotting
dependency: matplotlib is not one of mini3d's, and plotly's static export needs kaleido + a browser).

    python examples/plot_loss.py run.jsonl docs/loss_3d.svg --title "tp2 x pp2 x dp2"

Draws every step's loss (thin), its moving average (thick), and, as a dashed line, the unigram
entropy of the embedded corpus (the loss of a model that learned only byte frequencies; `--no-entropy`
leaves it out, e.g. for a run on --data).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

W, H, LEFT, RIGHT, TOP, BOTTOM = 720, 420, 64, 20, 40, 48


def read_log(path: str) -> list[tuple[int, float]]:
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [(int(r["step"]), float(r["loss"])) for r in recs]


def moving_average(values: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= k:
            acc -= values[i - k]
        out.append(acc / min(i + 1, k))
    return out


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    step = (hi - lo) / n
    return [lo + i * step for i in range(n + 1)]


def svg(points: list[tuple[int, float]], title: str, entropy: float | None) -> str:
    steps = [s for s, _ in points]
    losses = [v for _, v in points]
    smooth = moving_average(losses, max(1, len(losses) // 30))
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    ys = losses + ([entropy] if entropy is not None else [])
    y0, y1 = min(0.0, min(ys)), max(ys) * 1.05
    px = lambda s: LEFT + (s - x0) / (x1 - x0) * (W - LEFT - RIGHT)
    py = lambda v: TOP + (y1 - v) / (y1 - y0) * (H - TOP - BOTTOM)
    line = lambda vals, **a: (f'<polyline fill="none" points="'
                              + " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in zip(steps, vals))
                              + '" ' + " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in a.items())
                              + "/>")
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>']
    for v in _ticks(y0, y1):
        parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py(v):.1f}" y2="{py(v):.1f}" '
                     f'stroke="#e5e5e5"/><text x="{LEFT - 6}" y="{py(v) + 4:.1f}" '
                     f'text-anchor="end">{v:.1f}</text>')
    for s in _ticks(x0, x1):
        parts.append(f'<text x="{px(s):.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">'
                     f'{s:.0f}</text>')
    parts.append(f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle">optimizer step</text>')
    parts.append(f'<text x="16" y="{H / 2}" transform="rotate(-90 16 {H / 2})" '
                 f'text-anchor="middle">loss (nats / token)</text>')
    parts.append(line(losses, stroke="#9ecae1", stroke_width="1"))
    parts.append(line(smooth, stroke="#08519c", stroke_width="2.5"))
    if entropy is not None:
        parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py(entropy):.1f}" y2="{py(entropy):.1f}" '
                     f'stroke="#d62728" stroke-dasharray="6,4"/><text x="{W - RIGHT - 4}" '
                     f'y="{py(entropy) - 6:.1f}" text-anchor="end" fill="#d62728">unigram entropy '
                     f'{entropy:.2f}</text>')
    parts.append(f'<text x="{W - RIGHT - 4}" y="{TOP + 14}" text-anchor="end" fill="#08519c">'
                 f'final loss {smooth[-1]:.3f} (moving average)</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="a --log-jsonl file")
    ap.add_argument("out", nargs="?", default="docs/loss_3d.svg", help="the SVG to write")
    ap.add_argument("--title", default="mini3d train")
    ap.add_argument("--no-entropy", action="store_true", help="no unigram-entropy line")
    args = ap.parse_args(argv)
    try:
        points = read_log(args.log)
    except (OSError, ValueError, KeyError) as e:
        print(f"plot_loss: cannot read {args.log!r}: {e}", file=sys.stderr)
        return 2
    if not points:
        print(f"plot_loss: {args.log!r} holds no steps", file=sys.stderr)
        return 2
    entropy = None
    if not args.no_entropy:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from mini3d.data.corpus import load_tokens, unigram_entropy

        entropy = unigram_entropy(load_tokens())
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(svg(points, args.title, entropy))
    print(f"wrote {args.out} ({len(points)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
