"""Run matrix cases and compare each with the one-process run of the same seed and weights.

A case's RunConfig comes from its `mini3d train` flags through the CLI's own `validated_train` (the
run that a pasted line starts). The cases are grouped by world size; each group runs in ONE launch
(`run_cases`: the specs in sequence, in the same processes), so a matrix pays a process start-up
per world size, not per case. A case that hangs is ended by the hang watchdog (HANG_SECONDS) and
the group goes on in a new launch from the next case, so one broken case cannot hide the others. The references (tp=cp=pp=dp=1, one micro-batch, no
recomputation, explicit attention, float64; the case's model, clipping and validation) run in one
1-process launch, deduplicated.

Compared, every step: the loss, the global gradient norm before clipping (`--log-grad-norm`), and
the validation losses. Bounds (`BOUNDS`, by the case's dtype):

* float64: 1e-10 (loss and validation loss absolute, about 5; gradient norm relative). The layouts
  differ from the reference in summation order only (tp all-reduces, ring-attention merges, the
  dp mean of replica means, micro-batch sums), ~1e-16 relative an op; after 3 AdamW steps the
  measured deviations are ~1e-15. A real bug (a missing 1/m, a gradient summed twice, a stale
  shard) moves them by 1e-4 or more, and no machine's float64 summation order reaches 1e-10.
* float32 (random campaign): tests/test_3d.py's F32 loss bound 1e-5, and 1e-4 relative on the
  norm (its gradients agree to 3e-4 of each tensor's max after step 0; the norm averages those).
* bf16: tests/test_3d.py's BF16 bounds: losses 1e-2 absolute, and 3 % on the norm (its bound on
  ||g - g_ref|| / ||g_ref||, which bounds | ||g|| - ||g_ref|| | / ||g_ref|| by the triangle
  inequality), against the float64 reference.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import tempfile

from mini3d.launch.launcher import launch

from . import describe, flags, layers, parsed, world

BOUNDS = {"float64": dict(loss=1e-10, val_loss=1e-10, grad_norm=1e-10),
          "float32": dict(loss=1e-5, val_loss=1e-5, grad_norm=1e-4),
          "bf16": dict(loss=1e-2, val_loss=1e-2, grad_norm=0.03)}
STRICT = {"MINI3D_STRICT_DEVICE": "1"}  # a tensor made without a device fails, as on CUDA
CASE_SECONDS = 120  # a group's launch timeout: this per case (a slow shared machine), plus 60 s
HANG_SECONDS = 60  # an op pending this long is a hang: the watchdog ends the launch (mini3d.diagnose)


def prepare_data(root: str | None = None) -> str:
    """A `mini3d prepare` directory with a validation split (made once, then reused)."""
    from mini3d import cli

    root = root or os.path.join(tempfile.gettempdir(), "mini3d-matrix-data")
    out = os.path.join(root, "shards")
    if os.path.isdir(out):
        return out
    from pydoc_data.topics import topics

    os.makedirs(root, exist_ok=True)
    src = os.path.join(root, "corpus.txt")
    with open(src, "w") as f:
        f.write("".join(topics[k] for k in sorted(topics))[:120_000])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["prepare", src, "--out", out + ".tmp", "--val-fraction", "0.2",
                         "--no-progress"]) == 0
    os.replace(out + ".tmp", out)
    return out


def reference_of(case: dict) -> dict:
    """The one-process run `case` is compared with. With MoE layers it keeps the case's
    micro-batches, dp x micro_batches of them (dp's slices of the global batch, in order): the
    balancing loss is a function of each micro-batch's routing, not a mean over tokens."""
    m = case["dp"] * case["micro_batches"] if case.get("moe") else 1
    return {**case, "tp": 1, "cp": 1, "pp": 1, "dp": 1, "ep": 1, "zero": 0, "schedule": "1f1b", "sp": False,
            "recompute": "none", "micro_batches": m, "attention": "explicit", "dtype": "float64",
            "layers": layers(case)}  # the case's model


def spec_of(case: dict, data: str):
    """The RunConfig `mini3d train <flags(case)>` runs, or its exit code and message."""
    from mini3d.cli import validated_train

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        job = validated_train(parsed(case, data))
    if isinstance(job, int):
        return job, err.getvalue()
    spec = job[0]
    shutil.rmtree(spec.run_dir, ignore_errors=True)  # the CLI's temp run dir: nothing dumps here
    return spec.replace(run_dir=None), ""


def run_cases(specs: list) -> None:
    """On every rank: `train_worker` on each spec in turn. The reporting rank leaves each spec's
    records in its run directory (result-<i>.pkl); a rank whose spec raises leaves the error
    (error-<i>.txt) and ends the launch: the other ranks may still be inside that spec, so going on
    would pair its collectives with the next spec's. The first spec without a result is then the
    broken one (a hang too: the watchdog ends the launch after HANG_SECONDS)."""
    import torch.distributed as dist

    from mini3d.run.train import train_worker

    for i, spec in enumerate(specs):
        try:
            r = train_worker(spec)
        except Exception as e:
            with open(os.path.join(spec.run_dir, f"error-{i}.txt"), "w") as f:
                f.write(f"rank {dist.get_rank()}: {type(e).__name__}: {str(e)[:500]}")
            raise
        if r["reporter"]:
            with open(os.path.join(spec.run_dir, f"result-{i}.pkl"), "wb") as f:
                pickle.dump({"records": r["records"]}, f)


def _read(run_dir: str, j: int) -> dict | None:
    path = os.path.join(run_dir, f"result-{j}.pkl")
    if os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    path = os.path.join(run_dir, f"error-{j}.txt")
    if os.path.exists(path):
        with open(path) as f:
            return {"error": f.read()}
    return None


def _explained(run_dir: str, e: Exception) -> str:
    """The error, and for a hang the first lines of `mini3d explain-hang` (the dumps go with the
    run directory)."""
    from mini3d import cli
    from mini3d.launch.jobs import HangDetected

    if not isinstance(e, HangDetected):
        return str(e)[:300]
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        cli.main(["explain-hang", run_dir])
    return "hang: " + " | ".join(line.strip() for line in text.getvalue().splitlines()[:6])


def _launch_group(n: int, specs: list) -> list[dict]:
    """Each spec's records (or its error), from launches of n ranks: one, and after a failed one
    (a rank died, a hang) another for the specs it did not reach."""
    from mini3d.diagnose.watchdog import nccl_env

    out: dict = {}
    pending = list(range(len(specs)))
    while pending:
        run_dir = tempfile.mkdtemp(prefix="mini3d-matrix-")
        batch = [specs[i].replace(run_dir=run_dir, hang_timeout=HANG_SECONDS) for i in pending]
        failure = None
        try:
            launch(run_cases, n, batch, device="cpu", run_dir=run_dir,
                   env={**STRICT, **nccl_env(HANG_SECONDS, run_dir, "gloo")},
                   timeout=60 + CASE_SECONDS * len(batch))
        except Exception as e:  # noqa: BLE001 (a rank died or hung: named on its case below)
            failure = f"launch of {n} ranks failed: {type(e).__name__}: {_explained(run_dir, e)}"
        got = [_read(run_dir, j) for j in range(len(pending))]
        for j, i in enumerate(pending):
            if got[j] is not None and "error" not in got[j]:
                out[i] = got[j]
        if failure:  # the first spec without records broke the launch
            j = next((j for j, i in enumerate(pending) if i not in out), 0)
            out[pending[j]] = {"error": ((got[j] or {}).get("error", "") + "; " + failure)[:900]}
        shutil.rmtree(run_dir, ignore_errors=True)
        pending = [i for i in pending if i not in out]
    return [out[i] for i in range(len(specs))]


def run_groups(cases: list[dict], data: str, alone: tuple = (), done=None) -> list[dict]:
    """Each case's reporter result: one launch per world size; a failed launch is rerun one case
    a launch; cases whose index is in `alone` (expected failures) always run alone. `done(i,
    result)` is called as each group finishes."""
    specs = [spec_of(c, data)[0] for c in cases]
    out: list = [None] * len(cases)
    by_world: dict = {}
    for i, c in enumerate(cases):
        by_world.setdefault(world(c), []).append(i)
    for n, idx in sorted(by_world.items()):
        shared = [i for i in idx if i not in alone]
        got = _launch_group(n, [specs[i] for i in shared]) if shared else []
        for i, g in zip(shared, got):
            out[i] = g
        for i in idx:
            if i in alone:
                out[i] = _launch_group(n, [specs[i]])[0]
        for i in idx:
            if done:
                done(i, out[i])
    return out


def _series(result: dict) -> dict:
    recs = result["records"]
    return {"loss": [r["loss"] for r in recs], "grad_norm": [r["grad_norm"] for r in recs],
            "val_loss": [r["val_loss"] for r in recs if "val_loss" in r]}


def compare(case: dict, got: dict, ref: dict) -> dict:
    """{"ok", "metric", "step", "dev", "bound", "message"}: the worst deviation against its bound."""
    if "error" in got or "error" in ref:
        which = "case" if "error" in got else "reference"
        return dict(ok=False, metric="error", step=None, dev=float("inf"), bound=0.0,
                    message=f"{which}: {(got if which == 'case' else ref)['error']}")
    g, r, bounds = _series(got), _series(ref), BOUNDS[case["dtype"]]
    worst = dict(ok=True, metric="loss", step=0, dev=0.0, bound=bounds["loss"], message="")
    for metric, bound in bounds.items():
        if len(g[metric]) != len(r[metric]):
            return dict(ok=False, metric=metric, step=None, dev=float("inf"), bound=bound,
                        message=f"{len(g[metric])} {metric} records, reference {len(r[metric])}")
        for step, (a, b) in enumerate(zip(g[metric], r[metric])):
            dev = abs(a - b) / (abs(b) if metric == "grad_norm" else 1.0)
            if dev / bound > worst["dev"] / worst["bound"]:
                worst = dict(ok=dev <= bound, metric=metric, step=step, dev=dev, bound=bound,
                             message=f"{metric} step {step + 1}: {a!r} vs {b!r}")
    return worst


def run_matrix(cases: list[dict], data: str, alone: tuple = (), report=None) -> list[dict]:
    """Run `cases` and their references; one verdict (see `compare`) per case, in order (each
    also handed to `report` as its group finishes)."""
    key = lambda c: repr(sorted(reference_of(c).items()))  # noqa: E731
    refs = {key(c): reference_of(c) for c in cases}
    ref_results = dict(zip(refs, run_groups(list(refs.values()), data)))
    out: list = [None] * len(cases)

    def done(i, got):
        verdict = compare(cases[i], got, ref_results[key(cases[i])])
        out[i] = {**verdict, "name": describe(cases[i]), "flags": flags(cases[i], data)}
        if report:
            report(out[i])

    run_groups(cases, data, alone, done)
    return out


def check_exit2(case: dict, data: str, expected: list[str]) -> tuple[bool, str]:
    """`mini3d train <flags>` exits 2 before any process starts, naming each expected text."""
    code, message = spec_of(case, data)
    missing = [t for t in expected if t not in message]
    ok = code == 2 and not missing and "Nothing was started" in message
    return ok, (f"exit {code}" + (f", missing {missing}" if missing else "") + f": {message.strip()}")
