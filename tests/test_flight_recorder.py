"""explain-hang reads PyTorch's flight recorder dumps (a fabricated dump in the format of
torch/distributed/flight_recorder: a pickled dict with "version", "pg_config" and "entries"), and a
rank that exits on a detected hang asks torch to write its real one: gloo's, end to end in a real
hung job (this torch records gloo ops); NCCL's through a stand-in for `_dump_nccl_trace` (no GPU)."""

import pickle

import pytest
from torch._C import _distributed_c10d as c10d

from mini3d.diagnose import flight_recorder as fr
from mini3d.diagnose.cli import cmd_explain_hang


def _entry(seq, state, pg=("1", "dp"), op="nccl:all_reduce", sizes=((1024,),)):
    return {"record_id": seq, "pg_id": 1, "process_group": pg, "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": op, "time_created_ns": seq * 1000,
            "input_sizes": [list(s) for s in sizes], "input_dtypes": ["Float"],
            "output_sizes": [list(s) for s in sizes], "output_dtypes": ["Float"], "state": state,
            "duration_ms": None, "is_p2p": False, "retired": state == "completed",
            "timeout_ms": 600000, "frames": []}


def _write(run_dir, rank, entries):
    dump = {"version": "2.4", "pg_config": {"1": {"name": "1", "desc": "dp", "ranks": "[0, 1]"}},
            "pg_status": {}, "entries": entries}
    with open(run_dir / f"{fr.FLIGHT_RECORDER_PREFIX}{rank}", "wb") as f:
        pickle.dump(dump, f)


def test_flight_recorder_dumps_name_the_rank_that_is_behind(tmp_path, capsys):
    # rank 0 issued all_reduce #12 and waits in it; rank 1 stopped after #11
    _write(tmp_path, 0, [_entry(10, "completed"), _entry(11, "completed"), _entry(12, "started")])
    _write(tmp_path, 1, [_entry(10, "completed"), _entry(11, "completed")])
    (tmp_path / f"{fr.FLIGHT_RECORDER_PREFIX}x").write_text("not a dump")  # ignored
    dumps = fr.read_dumps(str(tmp_path))
    assert sorted(dumps) == [0, 1]
    assert fr.oldest_unfinished(dumps[0])["collective_seq_id"] == 12
    assert fr.oldest_unfinished(dumps[1]) is None
    assert fr.behind(dumps) == [(1, "1", 11, 12)]
    text = "\n".join(fr.summary_lines(str(tmp_path)))
    assert "rank 0: oldest unfinished op all_reduce #12 on process group 1 (dp), state started" in text
    assert "rank 1: all 2 recorded ops completed" in text
    assert "rank 1 is behind on process group 1: its last collective there is #11" in text
    # explain-hang prints it even when no mini3d dump was written (the job died first)
    assert cmd_explain_hang(type("A", (), {"dir": str(tmp_path)})()) == 0
    assert "rank 1 is behind" in capsys.readouterr().out


def test_no_flight_recorder_dumps_add_nothing(tmp_path):
    assert fr.summary_lines(str(tmp_path)) == []


def test_gloo_marks_a_finished_op_retired_not_completed():
    done, waiting = _entry(1, "scheduled"), _entry(2, "scheduled")
    done["retired"], waiting["retired"] = True, False  # what torch 2.13's gloo recorder writes
    assert fr.oldest_unfinished({"entries": [done, waiting]}) is waiting


def test_on_nccl_a_rank_asks_torch_for_the_nccl_record(tmp_path, monkeypatch):
    fake = {"version": "2.10", "pg_config": {}, "pg_status": {},
            "entries": [_entry(7, "started", op="nccl:all_gather")]}
    calls = []
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda *a, **k: calls.append(a) or
                        pickle.dumps(fake), raising=False)  # absent from a CPU build of torch
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda *a, **k: pytest.fail("gloo's recorder"))
    path = fr.write_dump(str(tmp_path), 3, backend="nccl")
    assert calls and path == str(tmp_path / f"{fr.FLIGHT_RECORDER_PREFIX}3")
    assert fr.read_dumps(str(tmp_path))[3] == fake
    assert "rank 3: oldest unfinished op all_gather #7" in "\n".join(fr.summary_lines(str(tmp_path)))
    # a torch without the call, or a recorder that is off, writes nothing and never raises
    monkeypatch.delattr(c10d, "_dump_nccl_trace")
    assert fr.write_dump(str(tmp_path / "x"), 0, backend="nccl") is None
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda *a, **k: pickle.dumps({"entries": []}))
    assert fr.write_dump(str(tmp_path / "x"), 0, backend="gloo") is None


def test_the_recorder_is_on_for_gloo_and_nccl_jobs():
    for backend in ("gloo", "nccl"):
        env = fr.nccl_env(3.0, "/run", backend)
        assert env["TORCH_FR_BUFFER_SIZE"] == fr.BUFFER
        assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/run/" + fr.FLIGHT_RECORDER_PREFIX
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in fr.nccl_env(3.0, "/run", "gloo")
    # NCCL's desync debug (a start event and a store write per collective) is the user's to turn on
    assert "TORCH_NCCL_DESYNC_DEBUG" not in fr.nccl_env(3.0, "/run", "nccl")
    assert fr.recorder_env("/run/job-1") == {"TORCH_FR_DUMP_TEMP_FILE": "/run/job-1/" + fr.FLIGHT_RECORDER_PREFIX}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_real_gloo_hang_leaves_torchs_flight_recorder_for_explain_hang(tmp_path):
    from mini3d.cli import main
    from mini3d.diagnose.explain import explain
    from tests.test_diag_faults import _children

    # rank 1 sleeps 60 s in step 1 while rank 0 waits in the dp all-reduce: a hang at 3 s
    run = tmp_path / "run"
    rc = main(["train", "--dp", "2", "--global-batch", "4", "--steps", "3", "--no-progress",
               "--hang-timeout", "3", "--timeout", "120", "--run-dir", str(run),
               "--inject-fault", "slow:1:1:60"])
    assert rc == 3
    assert _children() == []
    from mini3d.diagnose.run_dir import pick_job

    job, _ = pick_job(str(run))  # the job's own RUN_DIR/job-<id>, where its ranks dump
    dumps = fr.read_dumps(job)
    assert sorted(dumps) == [0, 1]  # written by torch (c10d._dump_fr_trace), one per rank
    assert all(e["profiling_name"].startswith("gloo:") for d in dumps.values() for e in d["entries"])
    waiting = fr.oldest_unfinished(dumps[0])
    assert waiting["profiling_name"] == "gloo:all_reduce" and fr.oldest_unfinished(dumps[1]) is None
    (behind,) = fr.behind(dumps)
    assert behind[0] == 1 and behind[2] == behind[3] - 1  # rank 1 never issued the one rank 0 waits in
    text = explain(str(run)).text
    assert "torch's flight recorder (nccl_trace_rank_<rank> from ranks [0, 1])" in text, text
    assert "rank 1 is behind on process group" in text, text
