"""explain-hang reads PyTorch's NCCL flight recorder dumps (a fabricated dump in the format of
torch/distributed/flight_recorder: a pickled dict with "version", "pg_config" and "entries")."""

import pickle

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
