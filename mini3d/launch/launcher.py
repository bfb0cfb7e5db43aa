"""Starting processes (backend and device are chosen in `mini3d.launch.devices`, and nowhere else).

`launch(fn, world_size, *args)` starts `world_size` local processes (on CPU forked from a server
that has imported torch and the engine once, on CUDA spawned: mini3d.launch.zygote; either works
from a Jupyter kernel as long as `fn` lives in an importable module), initialises
torch.distributed in each through a FileStore in a private directory (no network listener; gloo's
and NCCL's own sockets are pinned to the loopback interface), runs `fn(*args)`, and returns every
rank's result in rank order. The ranks start with SIGINT and SIGUSR1 blocked (until a stop handler
is installed, see mini3d.run.stop; a job that installs none is stopped by its launcher). A worker that raises ends the whole job with a `WorkerError` carrying
its traceback; a job past `timeout` is stopped with `LaunchTimeout`. Either way all children are
terminated (then killed) before `launch` returns or raises, and each child also dies with its
parent (PR_SET_PDEATHSIG, armed in mini3d.launch.boot before torch is imported) if the parent is killed.
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
import signal
import shutil
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
from mini3d.launch import zygote
from mini3d.launch.devices import (DEVICE_ENV, STRICT_ENV, LaunchError, _set_device, choose_device,
                                   current_device, device_index, device_memory, dump_memory_snapshot,
                                   enter_strict_device, pg_device_id, strict_device,
                                   THREADS_ENV, visible_gpus, worker_threads)  # (re-exported)
from mini3d.launch.jobs import (_ASKED, _CHILDREN, ABORT_MARKER, ABORTED_EXIT, HANG_EXIT, JOB_ENV,
                                STOP_SIGNALS, HangDetected, LaunchTimeout, WorkerError, _clear_run_dir,
                                abort_marker, forward_stop, new_job)
from mini3d.exits import exit_code_of
from mini3d.launch.p2p_record import P2POrderError, check_saved, save_worker_record, start_worker_record

PG_TIMEOUT_ENV = "MINI3D_PG_TIMEOUT_S"  # process-group timeout, set from --hang-timeout (watchdog.py)
_FAILURE_HOOKS: list = []  # this process' callables(exc) run before a failing worker reports
def on_failure(hook):
    """Register `hook(exc)` to run in this worker process when its function raises (e.g. a dump)."""
    _FAILURE_HOOKS.append(hook)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOOPBACK_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # gloo's and NCCL's own connections


def _rendezvous_dir() -> str:
    """A private directory for the job's FileStore (see mini3d.launch.rdzv: no listening socket)."""
    from mini3d.launch import rdzv

    return rdzv.make()


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def _die_with_parent():
    """Ask Linux to SIGKILL this process when its parent dies (no orphans if the launcher is killed).
    Spawned workers arm it earlier, in mini3d.launch.boot, before torch is imported."""
    from mini3d.launch.boot import die_with_parent

    die_with_parent()


def _pg_timeout(job_timeout: float | None):
    """The process group's timeout: --hang-timeout + 60 s when the diagnostics set it (so the
    mini3d watchdog reports first), else the job timeout (at least 30 s), else torch's default."""
    if os.environ.get(PG_TIMEOUT_ENV):
        return datetime.timedelta(seconds=float(os.environ[PG_TIMEOUT_ENV]))
    if job_timeout is None:
        return None
    return datetime.timedelta(seconds=max(30.0, job_timeout))


def init_from_env(device: str = "auto", backend: str | None = None, threads: int | None = None):
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend, device_type = choose_device(device, local_world, backend, per_process=True)
    _set_device(device_type, int(os.environ.get("LOCAL_RANK", "0")), local_world)
    threads = worker_threads(device_type, local_world, threads, cpu=None)  # (torchrun's on CPU)
    if threads is not None:
        torch.set_num_threads(threads)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", timeout=_pg_timeout(None),
                                device_id=pg_device_id(device_type))
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
                                timeout=_pg_timeout(timeout), device_id=pg_device_id(device_type))
        enter_strict_device()
        start_worker_record()  # MINI3D_CHECK_P2P=1: the p2p program, checked by the launcher
        result = fn(*args)
        save_worker_record(os.path.dirname(store_path), rank)
        q.put((rank, "ok", pickle.dumps(result), ""))
    except BaseException as e:  # report everything, including SystemExit and KeyboardInterrupt
        for hook in _FAILURE_HOOKS:
            try:
                hook(e)
            except Exception:
                pass
        q.put((rank, "error", f"{type(e).__name__}: {e}", traceback.format_exc(), exit_code_of(e),
               str(e)))
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
    deadline = time.monotonic() + grace  # a stopped (SIGSTOP) rank can never dump: not waited for
    while any(_process_state(p) == "running" for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    errors, tracebacks = {}, {}
    while True:
        try:
            rank, status, payload, tb, *code = q.get(timeout=0.05)
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


def _collect(procs, q, world_size: int, deadline: float, timeout: float) -> dict:
    """Every rank's result from the queue; a rank's error, a rank that died without a report, or
    the deadline raise (WorkerError, LaunchTimeout), and `launch` stops them all."""
    results: dict[int, object] = {}
    while len(results) < world_size:
        try:
            rank, status, payload, tb, *code = q.get(timeout=0.1)
        except queue.Empty:
            rank = None
        if rank is not None:
            if status != "ok":
                raise WorkerError(rank, payload, tb, *code)
            results[rank] = pickle.loads(payload)
            continue
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0) and r not in results:
                try:  # its own report may still be in flight
                    rank, status, payload, tb, *code = q.get(timeout=1.0)
                    if status != "ok":
                        raise WorkerError(rank, payload, tb, *code)
                    results[rank] = pickle.loads(payload)
                    break
                except queue.Empty:
                    raise WorkerError(r, f"process exited with code {p.exitcode} "
                                         f"(killed or crashed without a Python exception)")
        if time.monotonic() > deadline:
            raise LaunchTimeout(timeout, sorted(set(range(world_size)) - set(results)))
    return results


def launch(fn, world_size: int, *args, device: str = "auto", backend: str | None = None,
           timeout: float = 600.0, threads: int | None = None, env: dict | None = None,
           run_dir: str | None = None, grace: float = 5.0, job: str | None = None) -> list:
    """Run `fn(*args)` on `world_size` new local processes; return their results in rank order.

    With `run_dir`, a failure first writes the abort marker there and waits up to `grace` seconds
    for the ranks' watchdogs to dump their state, records every rank's exit in `launcher.json`, and
    reports a watchdog's exit (`HANG_EXIT`) as `HangDetected`. `job`: this job's id, with `run_dir`
    its own directory (`jobs.job_dir`: nothing to clear); without it a new id, and `run_dir`'s
    previous dumps are cleared."""
    backend, device_type = choose_device(device, world_size, backend)
    threads = worker_threads(device_type, world_size, threads)
    if run_dir is not None and job is None:
        _clear_run_dir(run_dir)
    elif run_dir is not None:
        os.makedirs(run_dir, exist_ok=True)
    job = job or new_job()
    env = {**(env or {}), JOB_ENV: job}
    ctx = zygote.context(device_type)
    rdzv = _rendezvous_dir()  # (first: it starts the resource tracker the queue would start)
    q = ctx.Queue()
    store_path = os.path.join(rdzv, "store")
    from mini3d.launch.boot import run as boot  # the target: arms die-with-parent before importing torch

    here = zygote.launch_context(ctx)  # environment, stdio, path, cwd: a forked rank takes ours
    procs = [ctx.Process(target=boot, name=f"mini3d-rank{r}", daemon=True,
                         args=(os.getpid(), here, pickle.dumps((_worker, r, world_size, store_path,
                                                                backend, device_type, threads, fn,
                                                                args, env, timeout)), q))
             for r in range(world_size)]
    deadline = time.monotonic() + timeout
    _CHILDREN.update(procs)
    try:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # the children inherit it
        try:
            for p in procs:
                p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # (ours: a pending Ctrl-C lands now)
        if _ASKED["stop"]:
            forward_stop()  # asked while a rank had no pid yet: it too must hear it
        results = _collect(procs, q, world_size, deadline, timeout)
        for p in procs:
            p.join(max(1.0, min(30.0, deadline - time.monotonic())))
        check_saved(rdzv, world_size, env)  # MINI3D_CHECK_P2P=1: NCCL's rules on every pair
    except (WorkerError, LaunchTimeout) as e:
        if run_dir is None:
            raise
        hung = _abort_and_record(procs, q, run_dir, grace, e, job)
        if hung is not None:
            raise HangDetected(hung, run_dir) from e
        raise
    finally:
        _stop(procs)
        _CHILDREN.difference_update(procs)
        q.close()
        shutil.rmtree(rdzv, ignore_errors=True)
    return [results[r] for r in range(world_size)]
