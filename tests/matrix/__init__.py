"""The combination matrix: parity cases that cover every PAIR of option values (issue 28).

A case is a dict {dimension: value} over `DIMS` below. It prints as the `mini3d train` flags that
run it (`flags(case)`), and those flags are what the runner parses (through the CLI's own
`validated_train`), so a failing line can be pasted into a shell. Each valid case trains a tiny
model for a few steps and is compared with the one-process run of the same seed and weights
(tests/matrix/run.py); each pair of values that only occurs in combinations Plan validation
refuses is covered by an exit-2 case whose message must name the offending values (`RULES`).

* tests/matrix/pairwise.py builds the covering array (greedy, AETG-like, deterministic);
* tests/matrix/run.py runs the cases, grouped by world size, one launch per group;
* `python -m tests.matrix` prints and runs the array, or N seeded random valid cases
  (`--random N --seed S`); tests/test_matrix.py is the CI test.
"""

from __future__ import annotations

from mini3d.config import ModelConfig, Plan
from mini3d.schedule_kinds import MULTI_CHUNK, SCHEDULES

# Every option value the matrix covers in pairs (float64 stands for float32: its bounds are tight and
# machine-independent; bf16 has its rounding bounds). pp=4 (8 layers) only in the random campaign.
DIMS = {
    "tp": (1, 2), "cp": (1, 2), "pp": (1, 2), "schedule": SCHEDULES, "dp": (1, 2),
    "zero": (0, 1, 2, 3), "tied": (False, True),
    "family": ("gpt2", "llama", "qwen2", "qwen3", "deepseek"),
    "sp": (False, True), "recompute": ("none", "selective", "full"), "clip": (False, True),
    "dtype": ("float64", "bf16"), "validation": (False, True), "micro_batches": (1, 4),
    "attention": ("explicit", "sdpa"), "moe": (False, True), "ep": (1, 2),
}
# moe=True: 4 routed experts, top-2, a small balancing loss per layer (the scope pp can carry)
MOE_FLAGS = ["--experts", "4", "--top-k", "2", "--aux-loss-coef", "0.01", "--aux-loss-scope", "layer"]
# family=deepseek: multi-head latent attention with every width different (q latent 12, kv latent 8,
# heads 6 + 4 rotary wide for q/k and 5 for v: v <= q/k, which ring attention (cp) needs), full
# attention (MLA has no grouped-query form); with moe=True also DeepSeek-V3's grouped sigmoid
# router (2 groups of 2 experts, the best group a token, scaled by 2.5)
MLA_FLAGS = ["--kv-heads", "4", "--q-lora-rank", "12", "--kv-lora-rank", "8", "--qk-rope-dim", "4",
             "--qk-nope-dim", "6", "--v-head-dim", "5"]
DEEPSEEK_MOE_FLAGS = ["--router", "sigmoid", "--route-groups", "2", "--route-topk-groups", "1",
                      "--routed-scaling-factor", "2.5"]
RANDOM_DIMS = {**DIMS, "pp": (1, 2, 4), "dtype": ("float64", "float32", "bf16")}
MAX_WORLD = 8  # gloo on CPU, one thread a rank
STEPS, SEED, GLOBAL_BATCH, SEQ_LEN, CLIP = 3, 1, 8, 16, 0.5  # CLIP binds: the norms are > 1


def world(case: dict) -> int:
    return case["tp"] * case["cp"] * case["pp"] * case["dp"]


def normalized(case: dict) -> dict:
    """Without a pipeline (pp=1) there is no schedule to choose: it is fixed to 1f1b (the default),
    and pairs with the schedule count only where pp > 1 (see `pairs_of`)."""
    return {**case, "schedule": "1f1b"} if case["pp"] == 1 else dict(case)


def pairs_of(case: dict) -> set:
    """The (dim, value, dim, value) pairs a case covers (dims in DIMS order)."""
    names = [d for d in DIMS if not (d == "schedule" and case["pp"] == 1)]
    return {(a, case[a], b, case[b]) for i, a in enumerate(names) for b in names[i + 1:]}


def layers(case: dict) -> int:
    """4 layers; 8 where pp x virtual stages needs them (pp=4 with two chunks a rank); a
    reference keeps its case's ("layers")."""
    return case.get("layers") or (8 if case["pp"] * _chunks(case) > 4 else 4)


def _chunks(case: dict) -> int:
    return 2 if case["schedule"] in MULTI_CHUNK else 1


def flags(case: dict, data: str = "DATA") -> list[str]:
    """The `mini3d train` flags of `case` (its data: a `mini3d prepare` directory with a val split)."""
    case = normalized(case)
    out = ["--model", "tiny", "--layers", str(layers(case)), "--hidden", "32", "--heads", "4",
           "--ffn", "128", "--family", case["family"],
           "--tie-embeddings" if case["tied"] else "--no-tie-embeddings"]
    deepseek = case["family"] == "deepseek"
    out += MLA_FLAGS if deepseek else [  # llama-like: grouped-query
        "--kv-heads", "4" if case["family"] == "gpt2" else "2"]
    for flag, name in (("--tp", "tp"), ("--cp", "cp"), ("--pp", "pp"), ("--dp", "dp"),
                       ("--zero", "zero"), ("--ep", "ep"), ("--schedule", "schedule"),
                       ("--micro-batches", "micro_batches"), ("--recompute", "recompute"),
                       ("--dtype", "dtype"), ("--attention", "attention")):
        out += [flag, str(case[name])]
    out += ["--virtual-stages", str(_chunks(case)), "--global-batch", str(GLOBAL_BATCH),
            "--seq-len", str(SEQ_LEN), "--bucket-mb", "0.01"]  # small buckets: several a stage
    out += ["--sequence-parallel"] if case["sp"] else []
    out += MOE_FLAGS if case.get("moe") else []
    out += DEEPSEEK_MOE_FLAGS if case.get("moe") and deepseek else []
    out += ["--grad-clip", str(CLIP)] if case["clip"] else []
    out += ["--eval-every", "2", "--eval-batches", "1"] if case["validation"] else []
    return out + ["--log-grad-norm", "--steps", str(STEPS), "--seed", str(SEED), "--data", data,
                  "--device", "cpu", "--no-progress"]


_PARSER = []


def parsed(case: dict, data: str = "DATA"):
    """`mini3d train`'s parsed arguments for `case` (the CLI's own parser: one source)."""
    from mini3d.cli import build_parser

    if not _PARSER:
        _PARSER.append(build_parser())
    return _PARSER[0].parse_args(["train", *flags(case, data)])


def model_of(case: dict) -> ModelConfig:
    from mini3d.run.flags import model_from_args

    return model_from_args(parsed(case))


def plan_of(case: dict) -> Plan:
    from mini3d.run.flags import plan_from_args

    return plan_from_args(parsed(case))


# Each refusal the matrix meets: (name, when it fires, text its exit-2 message must hold). Plan
# validation (mini3d/config.py), the run's (mini3d/run/config.py RunConfig.problems) and `mini3d
# train`'s run checks (mini3d/run/checks.py) own them; `refusals` must explain every problem those
# report for a matrix case (tests/test_matrix.py `problems_of`).
RULES = (
    ("zero3-pp", lambda c: c["zero"] == 3 and c["pp"] > 1,
     lambda c: [f"zero=3 with pp={c['pp']} is refused", "--zero 1"]),
    ("sp-without-tp", lambda c: c["sp"] and c["tp"] == 1,
     lambda c: ["--sequence-parallel needs --tp > 1"]),
    ("schedule-m<pp", lambda c: c["schedule"] in ("1f1b", "zb-h1") and c["micro_batches"] < c["pp"]
     and c["pp"] > 1, lambda c: [f"{c['schedule']} needs micro_batches >= pp, got micro_batches="
                                 f"{c['micro_batches']} < pp={c['pp']}"]),
    ("zbv-tied", lambda c: c["schedule"] == "zbv" and c["pp"] > 1 and c["tied"],
     lambda c: ["schedule='zbv'", "tied embeddings", "--schedule zb-h1"]),
    ("cp-selective", lambda c: c["cp"] > 1 and c["recompute"] == "selective",
     lambda c: ["recompute='selective'", "ring attention (cp > 1)"]),
    ("sdpa-selective", lambda c: c["attention"] == "sdpa" and c["recompute"] == "selective",
     lambda c: ["recompute='selective'", "attention='sdpa'"]),
    ("ep-dense", lambda c: c["ep"] > 1 and not c["moe"],
     lambda c: [f"ep={c['ep']} needs a mixture-of-experts model"]),
    ("ep-dp-cp", lambda c: (c["dp"] * c["cp"]) % c["ep"],
     lambda c: [f"ep={c['ep']} does not divide dp*cp = {c['dp']}*{c['cp']} = {c['dp'] * c['cp']}"]),
)


# Dimensions neither RULES nor the world size read: validity does not depend on their values
# (tests/test_matrix.py checks it), so the exhaustive search for impossible pairs
# (pairwise.possible) tries one value of each.
RULE_FREE = ("clip", "dtype", "validation")


def refusals(case: dict) -> list[str]:
    """The names of the RULES `case` breaks (empty: a valid case)."""
    return [name for name, fires, _ in RULES if fires(case)]


def expected_messages(case: dict) -> list[str]:
    return [text for name, fires, texts in RULES if fires(case) for text in texts(case)]


def is_valid(case: dict) -> bool:
    return world(case) <= MAX_WORLD and not refusals(case)


def describe(case: dict) -> str:
    """A short name: the values that differ from the defaults."""
    c = normalized(case)
    parts = [f"{k}{c[k]}" for k in ("tp", "cp", "pp", "dp", "ep") if c[k] > 1]
    parts += [c["schedule"]] if c["pp"] > 1 else []
    parts += [f"zero{c['zero']}"] if c["zero"] else []
    parts += [f"m{c['micro_batches']}", c["family"], c["dtype"], c["attention"]]
    parts += [name for name in ("tied", "sp", "clip", "validation", "moe") if c.get(name)]
    parts += [f"rc-{c['recompute']}"] if c["recompute"] != "none" else []
    return "-".join(parts)
