"""scripts/prepare_warm_start.py: held-out ids are disjoint from training ids and demos; bad requests are refused;
a SIGTERM leaves no env server behind."""

import os
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import prepare_warm_start  # noqa: E402


def test_held_out_ids_are_the_tail_and_never_trained_on():
    ids = list(range(0, 4000, 40))
    train, heldout = prepare_warm_start.split_ids(ids, heldout=30, demos=50)
    assert heldout == ids[-30:] and train == ids[:-30]
    assert not set(train) & set(heldout)  # demos are train[:demos], so they never meet held-out ids either


def test_too_few_ids_for_the_request_is_a_clear_error():
    with pytest.raises(SystemExit, match="too few for 30 held-out items plus 80 demos"):
        prepare_warm_start.split_ids(list(range(100)), heldout=30, demos=80)


@pytest.mark.parametrize("argv, message", [
    (["--env", "textcraft", "--out", "x", "--levels", "1"], "--levels is BabyAI's"),
    (["--env", "babyai", "--out", "x", "--levels", "41"], "--levels are 1-40"),
    (["--env", "textcraft", "--out", "x", "--demo-policy", "view"], "--demo-policy view is BabyAI's"),
])
def test_levels_are_checked_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit):
        prepare_warm_start.main(argv)
    assert message in capsys.readouterr().err


def test_sigterm_mid_run_stops_its_env_server(tmp_path):
    import psutil

    from tests.env_server_proc import require_venv

    require_venv("babyai")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    servers = []
    proc = subprocess.Popen([sys.executable, "scripts/prepare_warm_start.py", "--env", "babyai", "--out",
                             str(tmp_path), "--levels", "1", "--heldout", "5", "--demos", "60"], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # the ids are written while the server is up; the demos follow
            if "held-out item ids" in line:
                break
        servers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "env_gateway.servers.babyai" in " ".join(c.cmdline())]
        assert servers, "no env server under the run"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        gone, alive = psutil.wait_procs(servers, timeout=15)
        assert not alive, f"env server left running: {[p.pid for p in alive]}"
    finally:
        for process in [proc, *servers]:  # a failing run leaves nothing either
            try:
                process.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        proc.wait()
