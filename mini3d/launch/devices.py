"""Backend and device, chosen here and nowhere else: NCCL + CUDA when every local process has a
GPU, gloo + CPU when there is none (`choose_device`), which visible GPU a process takes
(`device_index`: LOCAL_RANK when it sees the node's GPUs, 0 when it sees exactly one), the
CUDA allocator's statistics and snapshots, the intra-op threads a rank runs (`worker_threads`), and
the strict-device mode (MINI3D_STRICT_DEVICE=1: torch's default device is `meta` while a worker
computes, so a tensor created without an explicit device fails on CPU as it would under NCCL).
`mini3d.launch.launcher` and torchrun's path call these; no other module calls torch.cuda but the
timeline clock's timing events (`mini3d.timeline_clock`; tests/test_device_path.py holds it).
"""

from __future__ import annotations

import contextlib
import os

import torch

DEVICE_ENV = "MINI3D_DEVICE"  # the device a worker computes on ("cpu", "cuda:3"), set at start-up
STRICT_ENV = "MINI3D_STRICT_DEVICE"  # "1": workers compute with torch's default device set to meta
THREADS_ENV = "MINI3D_THREADS"  # intra-op threads per rank, where worker_threads' default does not fit


class LaunchError(RuntimeError):
    """The job could not start as asked (e.g. --device cuda without enough GPUs)."""


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


def device_name(device: torch.device) -> str:
    """The CUDA device's marketing name ("NVIDIA H100 80GB HBM3"), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def dump_memory_snapshot(path: str) -> bool:
    """Write the CUDA allocator's recorded history (MINI3D_MEMORY_SNAPSHOT=1 starts the recording)
    for https://pytorch.org/memory_viz; False when there is nothing to write."""
    if not (torch.cuda.is_available() and os.environ.get("MINI3D_MEMORY_SNAPSHOT")):
        return False
    torch.cuda.memory._dump_snapshot(path)
    return True


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


def pg_device_id(device_type: str) -> torch.device | None:
    """`device_id` for init_process_group: this process' CUDA device, so NCCL creates its
    communicator at once and first use joins nothing (a pair communicator made lazily by a first
    send is a blocking join of both ranks: a ring of first sends hangs); None on CPU (gloo)."""
    return current_device() if device_type == "cuda" else None


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


@contextlib.contextmanager
def cuda_sync_warnings(device):
    """Inside: torch's CUDA sync debug mode at "warn" (a warning for every call that makes the host
    wait for the GPU); yields the list the warnings are collected in. A no-op list on other devices."""
    import warnings

    got: list = []
    if torch.device(device).type != "cuda":
        yield got
        return
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode(before)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor (a micro-batch) on `device`. Onto a GPU it is pinned first and copied without
    blocking: a pageable copy makes the host wait until the GPU has it, a stall per micro-batch."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def worker_threads(device_type: str, local_world: int, asked: int | None = None,
                   cpu: int | None = 1) -> int | None:
    """Intra-op threads for each rank (torch.set_num_threads); None: leave torch's own.

    Asked (the argument, else $MINI3D_THREADS) wins. CPU ranks get 1: the ranks themselves share
    the cores, and more threads a rank would only oversubscribe them (torchrun makes the same
    choice, OMP_NUM_THREADS=1, for more than one process a node). CUDA ranks get the host's cores
    shared among the node's ranks: their CPU work (pinned staging copies, checkpoint
    serialisation and hashing, tokenisation) would otherwise run on one core while the rest idle.
    `cpu`: an unasked CPU rank's count (launcher.init_from_env passes None under torchrun, whose
    own OMP_NUM_THREADS then stands)."""
    if asked is None and os.environ.get(THREADS_ENV):
        try:
            asked = int(os.environ[THREADS_ENV])
        except ValueError:
            raise LaunchError(f"{THREADS_ENV}={os.environ[THREADS_ENV]!r}: give a whole number of "
                              f"threads a rank (1 or more)") from None
    if asked is not None:
        if asked < 1:
            raise LaunchError(f"{THREADS_ENV} / threads={asked}: a rank needs 1 thread or more")
        return asked
    if device_type != "cuda":
        return cpu
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, local_world))


__all__ = ["DEVICE_ENV", "STRICT_ENV", "LaunchError", "visible_gpus", "device_index", "choose_device",
           "current_device", "pg_device_id", "device_memory", "device_name", "dump_memory_snapshot",
           "strict_device", "enter_strict_device", "to_device", "cuda_sync_warnings", "THREADS_ENV",
           "worker_threads"]
