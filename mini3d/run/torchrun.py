"""`mini3d train` under torchrun: this process is one rank of a job torchrun started.

The local launcher's failure handling among the ranks themselves (`mini3d.diagnose.torchrun`: one
shared run directory, the job's abort marker, the culprit-first report, mini3d's exit codes). An
engine module, not a diagnostics one, because it runs the training loop (`mini3d.run.train`), which
itself uses the diagnostics.
"""

from __future__ import annotations

import os
import sys

from mini3d.exits import EXIT_BAD_INPUT, exit_code_of


def train(spec, device: str, derived: bool) -> int:
    """Run this torchrun worker's share of the job; on failure, end as `finish` says."""
    import traceback

    import torch.distributed as dist

    from mini3d.diagnose.torchrun import agree_on_job, claim_marker, finish
    from mini3d.diagnose.save_clock import checkpoint_bytes
    from mini3d.diagnose.watchdog import nccl_env
    from mini3d.launch.launcher import _FAILURE_HOOKS, abort_marker, choose_device, init_from_env
    from mini3d.run.train import summary_line, train_worker

    run_dir = spec.run_dir  # a mini3d.run.config.RunConfig
    os.makedirs(run_dir, exist_ok=True)

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = choose_device(device, local, per_process=True)[0]
    save_bytes = checkpoint_bytes(spec.model.n_params()) if spec.save else 0  # its barriers' timeout
    os.environ.update(nccl_env(spec.hang_timeout, run_dir, backend, save_bytes))
    try:
        init_from_env(device)
    except (RuntimeError, ValueError) as e:  # e.g. MASTER_PORT taken by another process
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        print(f"mini3d train: bad input: torchrun's rendezvous at MASTER_ADDR:MASTER_PORT={where} "
              f"failed ({str(e).splitlines()[0][:200]}); choose a free --master-port / "
              f"--rdzv-endpoint. Nothing was trained.", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    root, run_dir = run_dir, agree_on_job(run_dir)  # this job's RUN_DIR/job-<id>
    spec = spec.replace(run_dir=run_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = train_worker(spec)
    except BaseException as e:  # as the local launcher's worker: report everything
        for hook in _FAILURE_HOOKS:
            try:
                hook(e)
            except Exception:
                pass
        mine = exit_code_of(e)  # its class's: OutOfMemory 4, NonFiniteLoss 5, else 1
        error = f"{type(e).__name__}: {e}"
        code = claim_marker(abort_marker(run_dir), rank, error.splitlines()[0], mine)
        finish(run_dir, rank, world, code, error, traceback.format_exc())
    stopped = result.get("interrupted")
    if stopped:  # every rank stopped at the same boundary (mini3d.run.stop)
        from mini3d.run import stop

        if rank == 0:
            where = f"; checkpoint saved at step {stopped['step']}" if stopped["saved"] else ""
            print(f"mini3d train: stopped by {stop.name(stopped['signal'])} after step "
                  f"{stopped['step']}{where}", file=sys.stderr, flush=True)
        return stop.exit_code(stopped["signal"])
    if result["reporter"]:
        print(summary_line(result["records"], spec.plan, result["device"]), flush=True)
    dist.barrier()
    if derived and rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0
