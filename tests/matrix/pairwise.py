"""A covering array of strength 2: few cases such that every pair of values of two dimensions
occurs in at least one valid case, or, where no valid case can hold it, in an exit-2 case.

Greedy, in the manner of AETG (Cohen et al., "The AETG system", IEEE TSE 1997): while pairs are
uncovered, build CANDIDATES candidate cases, each seeded with one uncovered pair and completed one
dimension at a time (in a shuffled order) with the value that covers the most uncovered pairs with
what is chosen so far (ties: the smaller world size, then the seeded random order); keep the valid
candidate covering the most pairs. Written here by hand (some sixty lines, deterministic for a seed)
because no well-kept library does this with constraints and it needs no more.

A pair is *possible* when some valid case holds it; that is decided by seeded random completions of
the pair (and, for the pairs none is found for, checked again by exhaustive search over the other
dimensions' values, pruned by the rules) so the exit-2 cases are exactly the impossible pairs.
"""

from __future__ import annotations

import itertools
import random

from . import DIMS, RULE_FREE, RULES, is_valid, normalized, pairs_of, refusals, world

CANDIDATES = 30
# a candidate's score: new pairs / cost ** WEIGHT; SEED the array's. Chosen (with the ep and deepseek
# dimensions) as the lightest of WEIGHT 1, 2 x seeds 0-5: 58 cases of total cost 358, where
# WEIGHT=2, seed 0 gave 64 cases of cost 444 (26 of 8 ranks)
WEIGHT, SEED = 1, 1


def cost(case: dict) -> float:
    """A case's relative CPU time: its ranks share two cores, so about linear in the world size
    (plus what every case pays: building the model, the reference's share)."""
    return world(case) + 2


def _all_pairs(dims: dict) -> set:
    """Every pair of values, but a schedule with pp=1 (no pipeline: nothing to schedule)."""
    names = list(dims)
    return {(a, x, b, y) for i, a in enumerate(names) for b in names[i + 1:]
            for x in dims[a] for y in dims[b] if ("pp", 1) not in ((a, x), (b, y))
            or "schedule" not in (a, b)}


def _completions(pair, dims: dict):
    """Every case holding `pair` that validity can tell apart (a generator over the product of
    the other dimensions; those no rule reads, `RULE_FREE`, keep their first value)."""
    a, x, b, y = pair
    rest = [d for d in dims if d not in (a, b)]
    for values in itertools.product(*(dims[d][:1] if d in RULE_FREE else dims[d] for d in rest)):
        yield {**dict(zip(rest, values)), a: x, b: y}


def possible(pair, dims: dict, rng: random.Random) -> bool:
    """Whether some valid case holds `pair` (whose schedule pairs mean pp > 1, see pairs_of)."""
    a, x, b, y = pair
    for _ in range(300):
        case = {d: rng.choice(v) for d, v in dims.items()} | {a: x, b: y}
        if is_valid(case) and pair in pairs_of(normalized(case)):
            return True
    return any(is_valid(c) and pair in pairs_of(normalized(c)) for c in _completions(pair, dims))


def _complete(pair, uncovered: set, dims: dict, rng: random.Random) -> dict:
    a, x, b, y = pair
    case = {a: x, b: y}
    order = [d for d in dims if d not in case]
    rng.shuffle(order)
    for d in order:
        def gain(v):
            trial = {**case, d: v}
            new = sum((e, trial[e], f, trial[f]) in uncovered or (f, trial[f], e, trial[e]) in uncovered
                      for e in trial for f in trial if e != f and d in (e, f))
            fill = {k: vals[0] for k, vals in dims.items()} | trial
            return (new / cost(fill) ** WEIGHT, -world(fill), rng.random())
        case[d] = max(dims[d], key=gain)
    return case


def covering_array(dims: dict = DIMS, seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """(valid cases, exit-2 cases): together they hold every pair of `dims` values."""
    rng = random.Random(seed)
    pairs = sorted(_all_pairs(dims), key=repr)
    impossible = [p for p in pairs if not possible(p, dims, rng)]
    uncovered = set(pairs) - set(impossible)
    valid = []
    while uncovered:
        seeds = sorted(uncovered, key=repr)
        best = None
        for _ in range(CANDIDATES):
            case = normalized(_complete(rng.choice(seeds), uncovered, dims, rng))
            if is_valid(case):
                new = len(pairs_of(case) & uncovered)
                score = (new / cost(case) ** WEIGHT, new) if new else (0, 0)
                if best is None or score > best[0]:
                    best = (score, case)
        if best is None or best[0][1] == 0:  # no greedy candidate was valid: a random valid case
            pair = rng.choice(seeds)
            best = (None, next(normalized(c) for c in _random_valid(pair, dims, rng)))
        valid.append(best[1])
        uncovered -= pairs_of(best[1])
    return valid, _exit2_cases(impossible, dims, rng)


def _random_valid(pair, dims, rng):
    a, x, b, y = pair
    while True:
        case = normalized({d: rng.choice(v) for d, v in dims.items()} | {a: x, b: y})
        if is_valid(case) and pair in pairs_of(case):
            yield case


def _exit2_cases(impossible: list, dims: dict, rng: random.Random) -> list[dict]:
    """One case per impossible pair not yet held by an earlier one, breaking as few rules as it
    can (a world size over 8 is not a refusal: those cases keep within it); then one case for each
    rule no such case breaks (a rule that only ever joins possible pairs, such as ep not dividing
    dp x cp: its message is checked too), breaking that rule alone."""
    out = []
    for pair in impossible:
        if any(pair in pairs_of(c) for c in out):
            continue
        tries = [normalized({d: rng.choice(v) for d, v in dims.items()} | dict([pair[:2], pair[2:]]))
                 for _ in range(400)]
        tries = [c for c in tries if world(c) <= 8 and pair in pairs_of(c) and refusals(c)]
        out.append(min(tries, key=lambda c: (len(refusals(c)), world(c))))
    for name, _, _ in RULES:
        if not any(name in refusals(c) for c in out):
            tries = (normalized({d: rng.choice(v) for d, v in dims.items()}) for _ in range(4000))
            tries = [c for c in tries if world(c) <= 8 and refusals(c) == [name]]
            if not tries:
                raise ValueError(f"rule {name!r}: no case of the dimensions breaks it alone")
            out.append(min(tries, key=world))
    return out


def random_valid_cases(n: int, seed: int, dims: dict) -> list[dict]:
    """`n` valid cases drawn uniformly from `dims` (rejection sampling; seeded, reproducible)."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        case = normalized({d: rng.choice(v) for d, v in dims.items()})
        if is_valid(case):
            out.append(case)
    return out
