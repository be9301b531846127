"""``SHARDNET_PROFILE``: a command's profile in pstats' format, written at its end and on SIGUSR2,
started afresh on SIGUSR1 (shardnet/cli/profiling.py)."""

import os
import pstats
import signal

from shardnet.cli.profiling import ENV, profiled_if_asked


def busy_before_the_window() -> int:
    return sum(range(1000))


def busy_in_the_window() -> int:
    return sum(range(1000))


def profiled_names(path) -> set[str]:
    return {name for _, _, name in pstats.Stats(str(path)).stats}


def test_nothing_is_profiled_without_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    before = signal.getsignal(signal.SIGUSR2)
    with profiled_if_asked():
        assert signal.getsignal(signal.SIGUSR2) is before
    assert not list(tmp_path.iterdir())


def test_a_window_scoped_by_signals(monkeypatch, tmp_path):
    path = tmp_path / "peer.prof"
    monkeypatch.setenv(ENV, str(path))
    before = signal.getsignal(signal.SIGUSR1)
    with profiled_if_asked():
        busy_before_the_window()
        os.kill(os.getpid(), signal.SIGUSR1)  # start afresh
        busy_in_the_window()
        os.kill(os.getpid(), signal.SIGUSR2)  # write it now
        names = profiled_names(path)
        assert "busy_in_the_window" in names and "busy_before_the_window" not in names
        busy_before_the_window()
    assert "busy_before_the_window" in profiled_names(path)  # written again at the end
    assert signal.getsignal(signal.SIGUSR1) is before  # the handlers are given back
    assert not (tmp_path / "peer.prof.tmp").exists()
