"""bench/torch_global.py's round logic and summary, without a GPU: the child processes are
stubbed (each returns a ROW as a real child prints it) and torch is a stand-in module, so the
harness's own code runs as on the device: the order of each round (rotated, or shuffled with
--shuffle), each row's position, the arguments passed to the children, and the A/A lines of
the summary. A GPU run lost to a harness bug costs a tenth of its device time."""
import importlib.util
import json
import re
import os
import sys
import types

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "torch_global.py")

if not os.path.isfile(BENCH):
    pytest.skip("bench/torch_global.py is not beside the tests (the wheel's venv)", allow_module_level=True)


def load():
    spec = importlib.util.spec_from_file_location("torch_global_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(tmp_path, monkeypatch, capsys, *args):
    tg = load()
    calls = []

    def fake_run(cmd, capture_output, text, timeout):
        mode = cmd[cmd.index("--child") + 1]
        calls.append(cmd)
        step = {"default": 30.0, "default-b": 31.0, "global": 29.0, "floor-reuse": 27.0}[mode] + len(calls) * 1e-3
        row = {"mode": mode, "probe py ms": 2.0, "probe launch us": 4.3, "train step ms": step,
               "train used GiB": 4.0, "loss": 6.9, "train at": [0, 1], "train gpu ms": step,
               "train enqueue ms": 19.0, "train pipelined ms": step, "probe after py ms": 2.0,
               "probe after launch us": 4.3, "train cpus": [1], "phases s": "start 3.0"}
        return types.SimpleNamespace(stdout="ROW " + json.dumps(row), stderr="")

    monkeypatch.setattr(tg.subprocess, "run", fake_run)
    for k, v in tg.NO_MULTICAST.items():  # main() sets these; restored after the test
        monkeypatch.setenv(k, v)
    fake_torch = types.ModuleType("torch")
    fake_torch.__version__ = "stand-in"
    fake_torch.cuda = types.SimpleNamespace(get_device_name=lambda i=0: "no GPU")
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setattr(sys, "argv", ["torch_global.py", "--model", "resnet50", "--no-micro",
                                      "--out", str(tmp_path), *args])
    tg.main()
    rounds = json.load(open(tmp_path / "torch_global.json"))
    return calls, rounds, capsys.readouterr().out


def orders(calls, n_modes):
    modes = [c[c.index("--child") + 1] for c in calls]
    return [modes[i:i + n_modes] for i in range(0, len(modes), n_modes)]


def test_rotation_positions_batch_and_the_aa_lines(tmp_path, monkeypatch, capsys):
    calls, rounds, out = run(tmp_path, monkeypatch, capsys, "--pairs", "3", "--batch", "16",
                             "--modes", "default,default-b,global")
    assert orders(calls, 3) == [["default", "default-b", "global"], ["default-b", "global", "default"],
                                ["global", "default", "default-b"]]
    assert all(c[c.index("--batch") + 1] == "16" for c in calls), "the batch reaches every child"
    for r, order in zip(rounds, orders(calls, 3)):
        assert [m for m, _ in sorted(r.items(), key=lambda kv: kv[1]["position"])] == order
    assert "per-pair default-b / default: median 1.033" in out
    assert "(the A/A control: the same allocator)" in out
    assert "per-pair global / default: median 0.967" in out


def test_shuffle_is_seeded_and_not_a_rotation(tmp_path, monkeypatch, capsys):
    modes = "default,default-b,global"
    first, _, _ = run(tmp_path, monkeypatch, capsys, "--pairs", "8", "--modes", modes, "--shuffle", "7")
    again, rounds, _ = run(tmp_path, monkeypatch, capsys, "--pairs", "8", "--modes", modes, "--shuffle", "7")
    assert orders(first, 3) == orders(again, 3), "the same seed, the same orders"
    rotations = [["default", "default-b", "global"], ["default-b", "global", "default"],
                 ["global", "default", "default-b"]]
    assert any(o not in rotations for o in orders(first, 3)), "a shuffle leaves the fixed cycle"
    for o in orders(first, 3):
        assert sorted(o) == sorted(modes.split(",")), "each round runs every mode once"
    for b in range(0, 6, 3):  # each block of 3 rounds puts every mode once at every position
        block = orders(first, 3)[b:b + 3]
        for pos in range(3):
            assert sorted(o[pos] for o in block) == sorted(modes.split(",")), (b, block)
    assert orders(first, 3)[0:3] != orders(first, 3)[3:6], "a new permutation per block"
    for r, order in zip(rounds, orders(again, 3)):
        assert [m for m, _ in sorted(r.items(), key=lambda kv: kv[1]["position"])] == order


def test_the_step_floor_trains_and_gets_its_line(tmp_path, monkeypatch, capsys):
    calls, rounds, out = run(tmp_path, monkeypatch, capsys, "--pairs", "2",
                             "--modes", "default,global,floor-reuse")
    assert sorted(o for o in orders(calls, 3)[0]) == ["default", "floor-reuse", "global"]
    assert all("train step ms" in r["floor-reuse"] for r in rounds)
    assert re.search(r"train step \(resnet50\) p50 ms.*floor-reuse 27\.00 \(0\.900x\)", out), out
    assert "per-pair floor-reuse / default: median 0.900" in out
    assert "(the floor: exact-size stacks)" in out
    assert "per-pair global / default: median 0.967" in out


def test_too_few_resnet_steps_is_refused_up_front(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        run(tmp_path, monkeypatch, capsys, "--pairs", "1", "--steps", "5")
    assert "--steps 5: the resnet50 step times the steps after its first 10" in capsys.readouterr().err
