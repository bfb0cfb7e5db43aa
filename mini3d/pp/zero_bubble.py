"""Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241).

Each backward is split in two actions: B(s, mb), the gradient of the stage input, which the
upstream stage waits for, and W(s, mb), the gradients of the stage's weights, which nobody waits
for. W can therefore run whenever the rank would otherwise idle, as long as the activations it
needs stay alive until then (a micro-batch is "in flight" from its F to its W).

* `zb_h1_orders(p, m)`: ZB-H1, the paper's handcrafted schedule with 1F1B's peak memory. The F and B
  actions sit where 1F1B puts F and the whole backward (rank r: p - r - 1 warm-up forwards, then
  one F and one B alternately); rank r runs the W of a micro-batch r micro-batches late, so rank r
  holds (p - r) + r = p micro-batches at its peak, the same p as 1F1B's first rank; the r deferred
  W of rank r fill its cool-down. With equal F, B, W costs the bubble drops from 1F1B's
  (p-1)(t_F+t_B+t_W) per rank to (p-1)(t_F+t_B-2 t_W)... see `bubble` in the tests: the simulator
  gives the exact value for any costs.
* `zbv_orders(p, m)`: ZB-V (the paper's section 6): two chunks per rank placed in a V (rank r holds stages
  r and 2p-1-r, so rank 0 holds the first and the last one, see `placement.stage_rank`); the
  handcrafted order below keeps at most 2p chunk activations (p micro-batches' worth of a rank's
  layers, 1F1B's peak) and, for t_F = t_B = t_W, idles only while the V fills and drains.

PyTorch ships the same two (`ScheduleInterleavedZeroBubble` with one stage per rank, which is
ZB-H1, and `ScheduleZBVZeroBubble`); tests/test_pp_torch_orders.py compares the orders.
"""

from __future__ import annotations

from mini3d.pp.actions import B, F, W


def zb_h1_orders(p: int, m: int) -> list[list]:
    """ZB-H1's compute order of every rank, p ranks and m >= p micro-batches (see the module
    docstring); `schedules.zb_h1` adds the transfers."""
    orders = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [F(r, i) for i in range(warm)]
        w_next = 0
        for k in range(m):  # the k-th B, preceded by a forward while forwards remain
            if warm + k < m:
                order.append(F(r, warm + k))
            order.append(B(r, k))
            if k >= r:  # rank r lets r B's run ahead of their W
                order.append(W(r, w_next))
                w_next += 1
        order += [W(r, i) for i in range(w_next, m)]
        orders.append(order)
    return orders


def _zbv_rank(p: int, n: int, r: int) -> list:
    """Rank r's ZB-V order for n >= 2p - 1 micro-batches (stages r "down", 2p-1-r "up")."""
    down, up = r, 2 * p - 1 - r
    cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0, "w0": 0, "w1": 0}
    order = []

    def act(kind, key):
        stage = down if key[-1] == "0" else up
        order.append(kind(stage, cnt[key]))
        cnt[key] += 1

    for _ in range(2 * (p - r) - 1):  # fill the V's first arm
        act(F, "f0")
    for _ in range(r):  # the other arm starts: alternate the two chunks' forwards
        act(F, "f1")
        act(F, "f0")
    for _ in range(p - r):  # the bottom of the V: the up chunk's first backwards
        act(F, "f1")
        act(B, "b1")
        act(W, "w1")
    while cnt["f1"] < cnt["f0"] or cnt["f0"] < n:  # steady: F B W on each chunk in turn
        if cnt["f0"] < n:
            act(F, "f0")
        act(B, "b0")
        act(W, "w0")
        act(F, "f1")
        act(B, "b1")
        act(W, "w1")
    for _ in range(r):  # cool-down: input gradients first, weights later
        act(B, "b0")
        act(B, "b1")
    for _ in range(p - r):
        act(B, "b0")
        act(W, "w0")
    while cnt["w1"] < cnt["b1"]:
        act(W, "w1")
    while cnt["w0"] < cnt["b0"]:
        act(W, "w0")
    return order


def zbv_orders(p: int, m: int) -> list[list]:
    """ZB-V's compute order of every rank, p ranks (2 chunks each) and any m >= 1: built for
    max(m, 2p - 1) micro-batches (what its warm-up needs), the extra ones' actions dropped;
    `schedules.zbv` adds the transfers (placement "v")."""
    return [_zbv_order(p, m, r) for r in range(p)]


def _zbv_order(p: int, m: int, r: int) -> list:
    return [a for a in _zbv_rank(p, max(m, 2 * p - 1), r) if a.mb < m]


__all__ = ["zb_h1_orders", "zbv_orders"]
