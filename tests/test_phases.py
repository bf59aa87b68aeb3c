"""The phase board a fault harness reads to say what a kill hit (``difftrain.train.phases``)."""

import os
import threading

from difftrain.train import phases


def test_the_board_shows_the_phases_a_rank_is_in_and_costs_nothing_unarmed(tmp_path, monkeypatch):
    monkeypatch.delenv("DIFFTRAIN_PHASE_BOARD", raising=False)
    phases.configure(0)
    with phases.phase("forward"):
        assert not list(tmp_path.iterdir())          # unarmed: no file, nothing recorded
    monkeypatch.setenv("DIFFTRAIN_PHASE_BOARD", str(tmp_path / "board"))
    phases.configure(1)
    try:
        assert phases.read(tmp_path / "board.rank1") == (os.getpid(), [])
        inside, leave = threading.Event(), threading.Event()

        def writer():                                 # an async save's thread, while the step goes on
            with phases.phase("write"):
                inside.set()
                leave.wait(5)

        t = threading.Thread(target=writer)
        t.start()
        inside.wait(5)
        with phases.phase("forward"):
            with phases.phase("forward"):             # nested entries count
                assert phases.read(tmp_path / "board.rank1")[1] == ["forward", "write"]
            assert phases.read(tmp_path / "board.rank1")[1] == ["forward", "write"]
        leave.set()
        t.join()
        assert phases.read(tmp_path / "board.rank1")[1] == []
        assert phases.read(tmp_path / "missing.rank0") is None
    finally:
        monkeypatch.delenv("DIFFTRAIN_PHASE_BOARD")
        phases.configure(0)
