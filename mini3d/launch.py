"""Starting processes: backend and device are chosen here and nowhere else.

`launch(fn, world_size, *args)` spawns `world_size` local processes (the `spawn` start method, so it
works from a Jupyter kernel as long as `fn` lives in an importable module), initialises
torch.distributed in each through a FileStore in a private directory (no network listener; gloo's
and NCCL's own sockets are pinned to the loopback interface), runs `fn(*args)`, and returns every
rank's result in rank order. A worker that raises ends the whole job with a `WorkerError` carrying that rank's
traceback; a job that runs past `timeout` is stopped with `LaunchTimeout`. In every case all children
are terminated (then killed) before `launch` returns or raises, and each child also dies with its
parent (PR_SET_PDEATHSIG) if the parent itself is killed.

Under `torchrun`, `init_from_env()` initialises from the environment it sets instead.

torch.multiprocessing.start_processes would spawn too, but it neither returns results nor applies a
timeout nor stops a job whose other ranks hang after one crashed; this file adds exactly those.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import queue
import shutil
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEVICE_ENV = "MINI3D_DEVICE"
STRICT_ENV = "MINI3D_STRICT_DEVICE"  # "1": workers compute with torch's default device set to meta
HANG_EXIT = 86  # exit status of a rank whose hang watchdog (mini3d.diagnose.watchdog) saw a hang
ABORTED_EXIT = 87  # exit status of a rank whose watchdog dumped because another rank failed
ABORT_MARKER = "ABORT"  # file in the run directory that tells every rank's watchdog to dump and exit
JOB_ENV = "MINI3D_JOB_ID"  # this job's id: its abort marker is ABORT-<id> (see abort_marker)
_FAILURE_HOOKS: list = []  # this process' callables(exc) run before a failing worker reports


class LaunchError(RuntimeError):
    """The job could not start as asked (e.g. --device cuda without enough GPUs)."""


class WorkerError(RuntimeError):
    """A rank raised or died; carries its rank and traceback."""

    def __init__(self, rank: int, message: str, tb: str = ""):
        self.rank, self.message, self.traceback = rank, message, tb
        text = f"rank {rank} failed: {message}"
        if tb:
            text += f"\n--- traceback from rank {rank} ---\n{tb.rstrip()}"
        super().__init__(text)


class LaunchTimeout(TimeoutError):
    """The job did not finish in time; `pending` lists the ranks that had not returned."""

    def __init__(self, timeout: float, pending: list[int]):
        self.pending = pending
        super().__init__(f"job did not finish within {timeout:.0f} s; ranks still running: {pending} "
                         f"(all processes were stopped)")


class HangDetected(LaunchTimeout):
    """A rank's watchdog saw an op pending past the hang timeout; every rank dumped to `run_dir`."""

    def __init__(self, rank: int, run_dir: str | None):
        self.rank, self.run_dir, self.pending = rank, run_dir, [rank]
        TimeoutError.__init__(self, f"hang detected by rank {rank}'s watchdog; every rank dumped its "
                                    f"communication state to {run_dir} (all processes were stopped); "
                                    f"run: mini3d explain-hang {run_dir}")


def abort_marker(run_dir: str, job: str | None = None) -> str:
    """RUN_DIR/ABORT-<job id>: one marker per job, so that neither a stale marker left by a failed
    job nor another job sharing the run directory can stop this one."""
    job = job or os.environ.get(JOB_ENV)
    return os.path.join(run_dir, f"{ABORT_MARKER}-{job}" if job else ABORT_MARKER)


def on_failure(hook):
    """Register `hook(exc)` to run in this worker process when its function raises (e.g. a dump)."""
    _FAILURE_HOOKS.append(hook)


def visible_gpus() -> int:
    """CUDA devices this process can see (CUDA_VISIBLE_DEVICES applied); 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_index(local_rank: int, local_world_size: int, n_visible: int) -> int:
    """The visible CUDA device a process computes on. Two layouts work: each process sees every
    GPU of the node (`torchrun`, the local launcher): device LOCAL_RANK; or each sees exactly one
    (Slurm `--gpus-per-task=1`, a per-process CUDA_VISIBLE_DEVICES): device 0."""
    if n_visible >= local_world_size:
        return local_rank
    if n_visible == 1:
        return 0
    raise LaunchError(f"--device cuda with {local_world_size} processes on this node needs one GPU "
                      f"per process: each process sees {n_visible} (need {local_world_size}, or "
                      f"exactly 1 each, e.g. Slurm --gpus-per-task=1)")


def choose_device(device: str = "auto", local_world_size: int = 1, backend: str | None = None,
                  per_process: bool = False) -> tuple[str, str]:
    """(backend, device type): NCCL + CUDA when the GPUs suffice, gloo + CPU when there are none.

    The GPUs suffice when this process sees one per local rank, or (`per_process`: the process
    is one of several started by torchrun / Slurm, each with its own view) exactly one. `auto`
    with some GPUs but too few is an error naming the counts, as `cuda` is: quietly training on
    the CPU of a GPU node is never what was meant (ask for `--device cpu` to do it on purpose)."""
    if device not in ("auto", "cpu", "cuda"):
        raise LaunchError(f"device={device!r} is unknown (choose auto, cpu or cuda)")
    n_gpu, asked = visible_gpus(), device
    if device == "auto":
        device = "cuda" if n_gpu else "cpu"
    if device == "cuda":
        if n_gpu == 0:
            raise LaunchError(f"--device cuda needs {local_world_size} GPUs on this node, found 0 "
                              f"(use --device cpu)")
        if not (n_gpu >= local_world_size or (per_process and n_gpu == 1)):
            raise LaunchError(f"--device {asked} needs {local_world_size} GPUs on this node, found "
                              f"{n_gpu} (one per local process; use --device cpu, or fewer local "
                              f"processes)")
    return backend or ("nccl" if device == "cuda" else "gloo"), device


def current_device() -> torch.device:
    """The device this process computes on, as set by `launch` or `init_from_env`."""
    return torch.device(os.environ.get(DEVICE_ENV, "cpu"))


def device_memory(device: torch.device) -> dict:
    """CUDA allocator statistics of `device` in bytes (allocated now, peak, capacity); {} on CPU."""
    if device.type != "cuda":
        return {}
    return {"allocated": int(torch.cuda.memory_allocated(device)),
            "peak": int(torch.cuda.max_memory_allocated(device)),
            "capacity": int(torch.cuda.get_device_properties(device).total_memory)}


def dump_memory_snapshot(path: str) -> bool:
    """Write the CUDA allocator's recorded history (MINI3D_MEMORY_SNAPSHOT=1 starts the recording)
    for https://pytorch.org/memory_viz; False when there is nothing to write."""
    if not (torch.cuda.is_available() and os.environ.get("MINI3D_MEMORY_SNAPSHOT")):
        return False
    torch.cuda.memory._dump_snapshot(path)
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOOPBACK_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # gloo's and NCCL's own connections


def _rendezvous_dir() -> str:
    """A private (0700) directory for the job's FileStore. Local ranks meet through a file, not a
    TCPStore: rank 0's TCPStore would listen on every interface, unauthenticated, and a port picked
    by `free_port` can be taken by another process before the store binds it again."""
    import tempfile

    return tempfile.mkdtemp(prefix="mini3d-rdzv-")


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def _die_with_parent():
    """Ask Linux to SIGKILL this process when its parent dies (no orphans if the launcher is killed).
    Spawned workers arm it earlier, in mini3d._boot, before torch is imported."""
    from ._boot import die_with_parent

    die_with_parent()


def _set_device(device_type: str, local_rank: int, local_world_size: int | None = None):
    if device_type == "cuda":
        index = local_rank if local_world_size is None else \
            device_index(local_rank, local_world_size, visible_gpus())
        torch.cuda.set_device(index)
        os.environ[DEVICE_ENV] = f"cuda:{index}"
        if os.environ.get("MINI3D_MEMORY_SNAPSHOT"):
            torch.cuda.memory._record_memory_history(max_entries=100_000)
    else:
        os.environ[DEVICE_ENV] = "cpu"


def strict_device() -> bool:
    """True when MINI3D_STRICT_DEVICE=1: this process must never rely on torch's default device."""
    return os.environ.get(STRICT_ENV, "") == "1"


def enter_strict_device():
    """Under MINI3D_STRICT_DEVICE=1, make torch's default device `meta` (this thread: where the
    worker computes, and on CPU its autograd too). A tensor created without an explicit device then
    has no data and no device of the run: any op mixing it with real tensors, and any collective
    on it, fails at once, as a stray CPU tensor fails under NCCL / CUDA."""
    if strict_device():
        torch.set_default_device("meta")


def init_from_env(device: str = "auto", backend: str | None = None, threads: int | None = None):
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend, device_type = choose_device(device, local_world, backend, per_process=True)
    _set_device(device_type, int(os.environ.get("LOCAL_RANK", "0")), local_world)
    if threads:
        torch.set_num_threads(threads)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://")
    enter_strict_device()
    return backend, device_type


def _worker(rank, world_size, store_path, backend, device_type, threads, fn, args, q, env, timeout):
    _die_with_parent()
    os.environ.update(env or {})
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    for var in LOOPBACK_ENV:  # the libraries' own sockets stay on loopback (unless the user chose)
        os.environ.setdefault(var, "lo")
    torch.set_num_threads(threads)
    try:
        _set_device(device_type, rank, world_size)
        store = dist.FileStore(store_path, world_size)  # no listening socket (see _rendezvous_dir)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=max(30.0, timeout)))
        enter_strict_device()
        result = fn(*args)
        q.put((rank, "ok", pickle.dumps(result), ""))
    except BaseException as e:  # report everything, including SystemExit and KeyboardInterrupt
        for hook in _FAILURE_HOOKS:
            try:
                hook(e)
            except Exception:
                pass
        q.put((rank, "error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        q.close()
        q.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # do not wait in destroy_process_group for peers that may be stuck
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _stop(procs):
    procs = [p for p in procs if p.pid is not None]  # a start() that failed leaves nothing to join
    for p in procs:
        if p.is_alive():  # a stopped process cannot act on SIGTERM: no point waiting for it
            p.kill() if _process_state(p) == "stopped" else p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


def _clear_run_dir(run_dir: str):
    """Remove a previous job's marker and dumps, so that they cannot abort or confuse this one."""
    os.makedirs(run_dir, exist_ok=True)
    for name in os.listdir(run_dir):
        if name in (ABORT_MARKER, "launcher.json") or (
                name.startswith("rank") and name.endswith((".json", ".stack", ".stderr"))):
            os.remove(os.path.join(run_dir, name))


def _process_state(p) -> str | None:
    """'stopped' (SIGSTOP, a debugger), 'running' (alive) or None (gone), from /proc."""
    if p.pid is None or p.exitcode is not None:
        return None
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    return "stopped" if code in ("T", "t") else None if code in ("Z", "X") else "running"


def _abort_and_record(procs, q, run_dir: str, grace: float, first, job: str) -> int | None:
    """Tell every watchdog to dump (abort marker), wait for them, write launcher.json.

    Returns the rank whose watchdog detected the hang, or None if no rank stopped for a hang."""
    os.makedirs(run_dir, exist_ok=True)
    try:
        fd = os.open(abort_marker(run_dir, job), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        with os.fdopen(fd, "w") as f:
            json.dump({"by": "launcher", "reason": str(first).splitlines()[0]}, f)
    except FileExistsError:
        pass  # a watchdog wrote it first
    deadline = time.monotonic() + grace
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    errors, tracebacks = {}, {}
    while True:
        try:
            rank, status, payload, tb = q.get(timeout=0.05)
        except (queue.Empty, OSError, EOFError):
            break
        if status != "ok":
            errors[rank], tracebacks[rank] = payload, tb
    if isinstance(first, WorkerError):
        errors.setdefault(first.rank, first.message)
        tracebacks.setdefault(first.rank, first.traceback)
    ranks = [{"rank": r, "exitcode": p.exitcode, "error": errors.get(r),
              "state": _process_state(p), "traceback": tracebacks.get(r) or None}
             for r, p in enumerate(procs)]
    with open(os.path.join(run_dir, "launcher.json"), "w") as f:
        json.dump({"first_failure": str(first).splitlines()[0], "job": job, "ranks": ranks}, f,
                  indent=1)
    hung = [r for r, p in enumerate(procs) if p.exitcode == HANG_EXIT]
    if not hung:
        return None
    try:
        with open(abort_marker(run_dir, job)) as f:
            by = json.load(f).get("by")
        return by if isinstance(by, int) else hung[0]
    except (OSError, ValueError):
        return hung[0]


def launch(fn, world_size: int, *args, device: str = "auto", backend: str | None = None,
           timeout: float = 600.0, threads: int = 1, env: dict | None = None,
           run_dir: str | None = None, grace: float = 5.0) -> list:
    """Run `fn(*args)` on `world_size` new local processes; return their results in rank order.

    With `run_dir`, a failure first writes the abort marker there and waits up to `grace` seconds
    for the ranks' watchdogs to dump their state, records every rank's exit in `launcher.json`, and
    reports a watchdog's exit (`HANG_EXIT`) as `HangDetected`."""
    backend, device_type = choose_device(device, world_size, backend)
    if run_dir is not None:
        _clear_run_dir(run_dir)
    import uuid

    job = uuid.uuid4().hex[:12]
    env = {**(env or {}), JOB_ENV: job}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rdzv = _rendezvous_dir()
    store_path = os.path.join(rdzv, "store")
    from ._boot import run as boot  # the spawn target: arms die-with-parent before importing torch

    procs = [ctx.Process(target=boot, name=f"mini3d-rank{r}", daemon=True,
                         args=(os.getpid(), pickle.dumps((_worker, r, world_size, store_path, backend,
                                                          device_type, threads, fn, args, env,
                                                          timeout)), q))
             for r in range(world_size)]
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(results) < world_size:
            try:
                rank, status, payload, tb = q.get(timeout=0.1)
            except queue.Empty:
                rank = None
            if rank is not None:
                if status != "ok":
                    raise WorkerError(rank, payload, tb)
                results[rank] = pickle.loads(payload)
                continue
            for r, p in enumerate(procs):
                if p.exitcode not in (None, 0) and r not in results:
                    try:  # its own report may still be in flight
                        rank, status, payload, tb = q.get(timeout=1.0)
                        if status != "ok":
                            raise WorkerError(rank, payload, tb)
                        results[rank] = pickle.loads(payload)
                        break
                    except queue.Empty:
                        raise WorkerError(r, f"process exited with code {p.exitcode} "
                                             f"(killed or crashed without a Python exception)")
            if time.monotonic() > deadline:
                raise LaunchTimeout(timeout, sorted(set(range(world_size)) - set(results)))
        for p in procs:
            p.join(max(1.0, min(30.0, deadline - time.monotonic())))
    except (WorkerError, LaunchTimeout) as e:
        if run_dir is None:
            raise
        hung = _abort_and_record(procs, q, run_dir, grace, e, job)
        if hung is not None:
            raise HangDetected(hung, run_dir) from e
        raise
    finally:
        _stop(procs)
        q.close()
        shutil.rmtree(rdzv, ignore_errors=True)
    return [results[r] for r in range(world_size)]
