import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every process a test launches (mini3d.launch.launcher workers, `python -m mini3d` subprocesses) computes
# with torch's default device set to meta, so a tensor created without an explicit device fails
# as it would under NCCL / CUDA (see mini3d/launch/launcher.py). The test process itself is not affected:
# its single-process reference computations stay ordinary CPU code. MINI3D_STRICT_DEVICE=0 turns
# it off for a local investigation.
STRICT = os.environ.setdefault("MINI3D_STRICT_DEVICE", "1")
# Every mini3d.launch.launcher job records each rank's point-to-point program, and the launcher checks it
# under NCCL's ordering rules once all ranks returned (mini3d/launch/p2p_record.py: pairwise one for one;
# mini3d/diagnose/p2p_order.py, registered here: the full simulation): every multi-process test is
# also judged on whether its p2p calls would hang on NCCL. MINI3D_CHECK_P2P=0 turns it off for a
# local investigation.
os.environ.setdefault("MINI3D_CHECK_P2P", "1")
from mini3d.diagnose.p2p_order import register  # noqa: E402

register()  # the simulation judges every launched job
# The course's graded exercises and notebooks run learner-facing code written for a CPU laptop
# (the grader's own scenario tensors too): they are not the engine's parity matrix, so they run
# with ordinary defaults. (Making the grader strict-clean belongs with the course machinery.)
# test_cost_local.py compares measured step times with the cost model: strict mode's default-device
# mode adds Python overhead to every torch call, which is not what the model predicts.
_NOT_STRICT = ("test_exercises.py", "test_course_notebooks.py", "test_browser.py",
               "test_cost_local.py")


def pytest_runtest_setup(item):
    import torch

    item._mini3d_threads = torch.get_num_threads()
    if item.path.name in _NOT_STRICT or item.path.suffix == ".ipynb":
        os.environ["MINI3D_STRICT_DEVICE"] = "0"


def pytest_runtest_teardown(item):
    """A test that leaves this process on another thread count fails here, by name: the
    in-process references (one thread, as every launched rank) would sum in another order after
    it, and tests that compare bits downstream would fail far from the cause."""
    import torch

    os.environ["MINI3D_STRICT_DEVICE"] = STRICT
    before = getattr(item, "_mini3d_threads", None)
    if before is not None and torch.get_num_threads() != before:
        now = torch.get_num_threads()
        torch.set_num_threads(before)
        pytest.fail(f"{item.nodeid} left torch on {now} threads (it found {before})", pytrace=False)


@pytest.fixture
def tiny():
    from mini3d.config import PRESETS

    return PRESETS["tiny"]


# ---- graded exercises (tests/test_exercises.py): which implementation, and a reproducible seed
def pytest_addoption(parser):
    parser.addoption("--impl", default="solutions", choices=("exercises", "solutions"),
                     help="grade exercises/ (your answers) or solutions/ (the references; CI)")
    parser.addoption("--grade-seed", type=int, default=None,
                     help="seed of the randomised exercise checks (default: MINI3D_GRADE_SEED or random)")


def _grade_seed(config):
    if not hasattr(config, "_mini3d_grade_seed"):
        seed = config.getoption("--grade-seed")
        if seed is None:
            seed = int(os.environ.get("MINI3D_GRADE_SEED", "0")) or int.from_bytes(os.urandom(3), "big")
        config._mini3d_grade_seed = seed
    return config._mini3d_grade_seed


def pytest_report_header(config):
    return (f"mini3d exercises: --impl {config.getoption('--impl')}, grading seed "
            f"{_grade_seed(config)} (reproduce with --grade-seed {_grade_seed(config)})")


@pytest.fixture(scope="session")
def grade_seed(request):
    return _grade_seed(request.config)


@pytest.fixture(scope="session")
def impl(request):
    return request.config.getoption("--impl")


# ---- one 8-rank launch for the files with 8-rank runs (tests/test_3d.py, test_3d_llama.py,
# test_pp_zero_bubble_3d.py, test_checkpoint.py, test_strict_device.py): 8 processes starting and
# importing torch is the costliest part of such a launch on 2 cores, so the runs of every selected
# module run in turn in the same processes
@pytest.fixture(scope="session")
def eight_rank_job(request, tmp_path_factory):
    """{module name: its results} for each module of this session with a test using this fixture.
    Such a module defines EIGHT_RANK_TIMEOUT (its share of the launch's timeout, in seconds) and
    either EIGHT_RANK_LAYOUTS = (cases, model config dict), its results then every rank's
    `tests.threed_workers.run_layouts` results, or eight_rank_specs(tmp_dir) -> train specs, its
    results then (tmp_dir, every rank's `run_specs` results). One `tests.threed_workers.run_parts`
    launch runs them all, in collection order; a session selecting one module launches its runs
    only."""
    from mini3d.launch.launcher import launch
    from tests.test_3d import SEED, STEPS
    from tests.threed_workers import run_parts

    modules, parts, tmp = [], [], {}
    for item in request.session.items:
        if "eight_rank_job" in getattr(item, "fixturenames", ()) and item.module not in modules:
            modules.append(item.module)
    for m in modules:
        if hasattr(m, "EIGHT_RANK_LAYOUTS"):
            parts.append(("layouts", *m.EIGHT_RANK_LAYOUTS))
        else:
            tmp[m] = str(tmp_path_factory.mktemp(m.__name__.rsplit(".", 1)[-1]))
            parts.append(("specs", m.eight_rank_specs(tmp[m])))
    ranks = launch(run_parts, 8, parts, STEPS, SEED, device="cpu",
                   timeout=sum(m.EIGHT_RANK_TIMEOUT for m in modules))
    out = {}
    for i, m in enumerate(modules):
        results = [per_rank[i] for per_rank in ranks]
        out[m.__name__] = (tmp[m], results) if m in tmp else results
    return out


# ---- one 4-rank launch for the files with 4-rank runs (tests/test_3d.py, test_cp_train.py,
# test_pairs.py), as eight_rank_job above
@pytest.fixture(scope="session")
def four_rank_job(request, tmp_path_factory):
    """{module name: (tmp_dir, [every rank's results of each of its parts])} for each module of
    this session with a test using this fixture. Such a module defines FOUR_RANK_TIMEOUT (its share
    of the launch's timeout, in seconds) and four_rank_parts(tmp_dir) -> its parts, each one
    `tests.threed_workers.run_parts` runs: ("layouts", cases, cfg_dict), ("cp_layouts", cases,
    cfg_dict) or ("specs", specs). One launch runs every module's parts, in collection order."""
    from mini3d.launch.launcher import launch
    from tests.test_3d import SEED, STEPS
    from tests.threed_workers import run_parts

    modules, parts, spans = [], [], {}
    for item in request.session.items:
        if "four_rank_job" in getattr(item, "fixturenames", ()) and item.module not in modules:
            modules.append(item.module)
    for m in modules:
        tmp = str(tmp_path_factory.mktemp(m.__name__.rsplit(".", 1)[-1]))
        mine = m.four_rank_parts(tmp)
        spans[m] = (tmp, range(len(parts), len(parts) + len(mine)))
        parts += mine
    ranks = launch(run_parts, 4, parts, STEPS, SEED, device="cpu",
                   timeout=sum(m.FOUR_RANK_TIMEOUT for m in modules))
    return {m.__name__: (tmp, [[per_rank[i] for per_rank in ranks] for i in idx])
            for m, (tmp, idx) in spans.items()}
