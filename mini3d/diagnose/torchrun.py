"""`mini3d train` under torchrun, with the local launcher's failure handling.

Plainly run, `mini3d train` is its ranks' parent: it writes the abort marker, collects every rank's
exit, names the culprit and maps the outcome to exit code 1 / 3 / 4. Under torchrun there is no such
parent (torchrun's agent only restarts or stops workers), so the ranks do it among themselves
through the run directory, which every rank must see: `--run-dir` (required with several nodes,
on a filesystem all of them share), else `TMPDIR/mini3d-run-<rendezvous id>` on one node.

A failing rank (its own exception, or its watchdog seeing a hang or another rank's abort marker):

1. dumps its state (the watchdog's hooks) and writes the job's abort marker, with the job's exit
   code in it (the first failure decides: 3 a hang, 4 out of memory, 1 otherwise), so every other
   rank's watchdog dumps and ends with that code too;
2. records its own exit in `rank{r}.exit.json`;
   (all of it in the job's own directory RUN_DIR/job-<id>, see `agree_on_job`);
3. the first to create `REPORT-<job>` waits (up to GRACE s) for every rank's dump, writes
   launcher.json from the exit records and prints the culprit-first report; the others wait for
   it (`REPORTED-<job>`) before exiting, so that torchrun's agent, which stops the whole group when
   one worker exits, does not cut the report short.

Each worker process exits with mini3d's code (torchrun's summary shows it as the rank's
`exitcode`; torchrun's own status is 1 whenever a worker failed). A rank killed outright (SIGKILL,
the OOM killer) cannot take part: the others then name it as the rank that left no dump.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

MODE_ENV = "MINI3D_TORCHRUN"  # set in torchrun workers: the watchdog ends through `finish`
GRACE = 5.0
EXIT_FAILED, EXIT_HUNG, EXIT_OOM = 1, 3, 4


def active() -> bool:
    return os.environ.get(MODE_ENV) == "1"


def run_dir_for(run_dir: str | None) -> tuple[str | None, str | None]:
    """(the shared run directory, a problem): --run-dir, else one derived from the rendezvous id
    when every rank is on this node; several nodes must name a shared directory."""
    if run_dir:
        return run_dir, None
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world > local:
        return None, (f"under torchrun on several nodes (WORLD_SIZE={world} > LOCAL_WORLD_SIZE="
                      f"{local}) --run-dir is required: a directory on a filesystem every node "
                      f"shares, where all ranks meet to abort together and dump their state")
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return os.path.join(tempfile.gettempdir(), f"mini3d-run-{rid}"), None


def agree_on_job(run_dir: str) -> str:
    """Collective: one job id for every rank (rank 0 draws it), set as MINI3D_JOB_ID; returns the
    job's own directory RUN_DIR/job-<id> (made by rank 0), where the ranks dump and report, so that
    a later job sharing the run directory never clears this one's post-mortem; torch's automatic
    flight-recorder dumps are pointed there too (they were set to RUN_DIR before the process group
    existed, and so before the job had an id)."""
    import torch.distributed as dist

    from mini3d.diagnose.flight_recorder import recorder_env
    from mini3d.launch.jobs import JOB_ENV, job_dir, new_job

    box = [new_job() if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        job_dir(run_dir, box[0])
    dist.broadcast_object_list(box, src=0)
    os.environ[JOB_ENV] = box[0]
    os.environ[MODE_ENV] = "1"
    os.environ.update(recorder_env(job_dir(run_dir, box[0])))
    return job_dir(run_dir, box[0])


def marker_code(path: str, default: int = EXIT_FAILED) -> int:
    try:
        with open(path) as f:
            return int(json.load(f).get("code", default))
    except (OSError, ValueError, TypeError):
        return default


def claim_marker(path: str, rank: int, reason: str, code: int) -> int:
    """Write the job's abort marker unless another rank did; returns the job's exit code."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return marker_code(path, code)
    with os.fdopen(fd, "w") as f:
        json.dump({"by": rank, "reason": reason, "code": code}, f)
    return code


def _write_json(path: str, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def _launcher_json(run_dir: str, world: int, job: str):
    """launcher.json as the local launcher would write it, from the ranks' exit records."""
    ranks = []
    for r in range(world):
        try:
            with open(os.path.join(run_dir, f"rank{r}.exit.json")) as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            ranks.append({"rank": r, "exitcode": None, "error": None, "state": None})
    _write_json(os.path.join(run_dir, "launcher.json"), {"first_failure": "", "job": job,
                                                         "ranks": ranks})


def finish(run_dir: str, rank: int, world: int, code: int, error: str | None = None,
           tb: str | None = None):
    """Record this rank's exit, report (one rank) or wait for the report, and end the process."""
    from mini3d.launch.launcher import JOB_ENV
    from mini3d.diagnose.report import failure_report

    job = os.environ.get(JOB_ENV, "")
    _write_json(os.path.join(run_dir, f"rank{rank}.exit.json"),
                {"rank": rank, "exitcode": code if error else None, "error": error,
                 "traceback": tb, "state": None})
    done = os.path.join(run_dir, f"REPORTED-{job}")
    deadline = time.monotonic() + GRACE
    try:
        os.close(os.open(os.path.join(run_dir, f"REPORT-{job}"), os.O_CREAT | os.O_EXCL))
        reporter = True
    except FileExistsError:
        reporter = False
    if reporter:
        have = lambda r: any(os.path.exists(os.path.join(run_dir, f"rank{r}{x}"))
                             for x in (".json", ".exit.json"))
        while time.monotonic() < deadline and not all(have(r) for r in range(world)):
            time.sleep(0.05)
        _launcher_json(run_dir, world, job)
        lines = failure_report(run_dir) or [error or f"rank {rank} failed"]
        print("mini3d train: " + "\n".join(lines), file=sys.stderr, flush=True)
        open(done, "w").close()
    else:
        while time.monotonic() < deadline + GRACE and not os.path.exists(done):
            time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["active", "run_dir_for", "agree_on_job", "finish", "claim_marker"]
