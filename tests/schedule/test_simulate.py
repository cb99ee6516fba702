"""Simulator: closed-form bubbles and memory of every schedule, calibration, CLI, pictures."""

import json
import os
import resource
import subprocess
import sys
import threading

import pytest

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.calibrate import costs_from_trace
from hpcpipe.schedule.costs import Costs
from hpcpipe.schedule.event_sim import simulate, simulate_schedule
from hpcpipe.schedule.ir import Action, PipeShape
from hpcpipe.schedule.lower import lower
from hpcpipe.schedule.registry import build_schedule, shape_of
from hpcpipe.simulate import main

SIZES = [(p, m) for p in range(1, 9) for m in (1, 2, 3, 5, 8, 13, 16, 32)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("costs", [Costs(1, 2, 1), Costs(1.5, 2.25, 1)])
def test_gpipe_and_1f1b_bubble_closed_form(name, costs):
    for p, m in SIZES:
        result = simulate_schedule(name, p, m, costs=costs)
        assert result.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (name, p, m)
        assert result.step_time == pytest.approx((m + p - 1) * (costs.forward + costs.backward))


def test_peak_activations_gpipe_m_and_1f1b_min_p_minus_stage():
    for p, m in SIZES:
        assert simulate_schedule("gpipe", p, m).peak_stashed == [m] * p
        assert simulate_schedule("1f1b", p, m).peak_stashed == [min(p - r, m) for r in range(p)], (p, m)


def test_interleaved_bubble_relative_to_compute():
    for p in range(1, 9):
        for v in (2, 3):
            for m in (p, 2 * p, 4 * p):
                result = simulate_schedule("interleaved-1f1b", p, m, v, Costs(1, 2, 1))
                assert result.bubble_over_compute == pytest.approx((p - 1) / (v * m), abs=1e-12), (p, m, v)


def test_zero_bubble_h1_has_a_third_of_1f1b_bubble():
    for p in range(2, 9):
        for m in (p, p + 1, 2 * p, 32):
            zb = simulate_schedule("zb-h1", p, m, costs=Costs(1, 2, 1))
            ref = simulate_schedule("1f1b", p, m, costs=Costs(1, 2, 1))
            idle = p * zb.step_time - sum(zb.busy)
            idle_ref = p * ref.step_time - sum(ref.busy)
            assert idle == pytest.approx(idle_ref / 3), (p, m)
            assert max(zb.peak_stashed) <= min(p, m)


def test_comm_cost_lengthens_the_step():
    base = simulate_schedule("gpipe", 4, 8, costs=Costs(1, 2, 1, 0.0))
    slow = simulate_schedule("gpipe", 4, 8, costs=Costs(1, 2, 1, 0.5))
    # the critical path crosses 2 * (p - 1) messages
    assert slow.step_time == pytest.approx(base.step_time + 2 * 3 * 0.5)


def test_simulator_detects_deadlock():
    compute = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
               [Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1)]]
    with pytest.raises(ScheduleError, match="deadlocked"):
        shape = PipeShape(2, 2, 2, "interleaved")
        simulate(lower(compute, shape), shape, Costs())


def _fake_trace(path, f=0.01, b=0.02):
    events = []
    for step in range(2):
        t = 0.0
        for r in range(2):
            for op, stage, dur in (("F", r, f), ("B", r, b), ("RECV_F", r, 0.001), ("ALLREDUCE", -1, 0.002)):
                events.append({"name": f"s{stage}{op}0", "cat": op, "ph": "X", "ts": t * 1e6, "dur": dur * 1e6,
                               "pid": 0, "tid": r, "args": {"stage": stage, "mb": 0, "step": step}})
                t += dur
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_costs_from_trace(tmp_path):
    costs = costs_from_trace(_fake_trace(tmp_path / "t.json"))
    assert costs.forward == pytest.approx(0.01)
    assert costs.backward == pytest.approx(0.02)
    assert costs.comm == pytest.approx(0.001)
    assert costs.step == pytest.approx(0.002)
    assert costs.of("F", 1) == pytest.approx(0.01)


def test_cli_prints_step_time_bubble_and_peaks(capsys):
    assert main(["--schedule", "1f1b", "--pp", "8", "--micro-batches", "32", "--costs", "1,2,1,0"]) == 0
    out = capsys.readouterr().out
    assert "step time        117" in out
    assert f"{7 / 39:.4f}" in out
    assert "r0:8 r1:7" in out and "r7:1" in out


def test_cli_says_the_unit_of_the_step_time(capsys, tmp_path):
    """`step time 117` had no unit: --costs are in the user's unit, a trace's in seconds."""
    assert main(["--pp", "4", "--costs", "1,2,1,0"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step time"))
    assert line.endswith("units of --costs (F,B[,W[,comm]] = 1,2,1,0 per stage; seconds when they are seconds)")
    assert main(["--pp", "2", "--calibrate", str(_fake_trace(tmp_path / "t.json"))]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step time"))
    assert " s (costs measured in " in line


def test_cli_into_a_reader_that_left_stops_quietly():
    import subprocess
    import sys

    line = f"{sys.executable} -m hpcpipe.simulate --schedule 1f1b --pp 8 --micro-batches 32 --ascii | true"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", line], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr      # was: a BrokenPipeError traceback


def test_cli_bad_costs_and_schedule_exit_2(capsys):
    assert main(["--costs", "1,x"]) == 2
    for costs in ("1,nan,1,1", "1,inf", "nan,1"):            # were accepted: "step time nan units", exit 0
        assert main(["--costs", costs]) == 2
        assert f"finite non-negative numbers F,B[,W[,comm]], got '{costs}'" in capsys.readouterr().err
    assert main(["--tp", "2", "--tp-comm", "nan,0"]) == 2
    assert "--tp-comm expects two finite non-negative numbers" in capsys.readouterr().err
    assert main(["--schedule", "interleaved-1f1b", "--pp", "4", "--micro-batches", "6",
                 "--virtual-stages", "2"]) == 2
    assert "micro-batches: 6" in capsys.readouterr().err


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "t.png"
    assert main(["--schedule", "zb-h1", "--pp", "4", "--micro-batches", "8", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    measured = tmp_path / "m.png"
    assert main(["--measured", _fake_trace(tmp_path / "t.json"), "--plot", str(measured)]) == 0
    assert measured.stat().st_size > 0


@pytest.mark.parametrize("where, words", [("nodir/t.png", "does not exist or is not writable"),
                                          ("t.txt", "cannot write a txt file")])
def test_a_plot_path_matplotlib_cannot_write_is_one_line_before_simulating(tmp_path, capsys, where, words):
    # were tracebacks after the simulation ran (FileNotFoundError; matplotlib's ValueError)
    pytest.importorskip("matplotlib")
    assert main(["--pp", "4", "--micro-batches", "8", "--plot", str(tmp_path / where)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("error:") == 1 and words in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_schedule_too_large_for_memory_is_one_line():
    # was numpy's _ArrayMemoryError traceback (--pp 100000 --micro-batches 100000 asks 37 GiB); the address space
    # capped at 3 GiB so that any host runs out the same way
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    proc = subprocess.run([sys.executable, "-m", "hpcpipe.simulate", "--pp", "100000", "--micro-batches", "100000"],
                          capture_output=True, text=True, timeout=120, preexec_fn=cap, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "--pp 100000 --micro-batches 100000 --virtual-stages 1 is a timeline of about 4.0e+10 cells" in proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, words", [
    (["--pp", "100000"], "is a timeline of about 2.0e+10 cells"),
    (["--pp", "4", "--micro-batches", "10000000"], "is a timeline of about 8.0e+07 cells"),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "100000"], "walked 100000 time(s)"),
    (["--pp", "64", "--micro-batches", "4096", "--ascii"], "262144 stage micro-batches, too many to simulate action"),
    (["--pp", "1000", "--micro-batches", "1000", "--cores", "2"], "too many to simulate action by action"),
])
def test_a_simulation_too_large_to_run_in_seconds_is_refused_in_one_line(argv, words):
    # --pp 100000 grew past 20 GB in a minute, --micro-batches 10000000 and --virtual-stages 100000 ran for
    # minutes (the peaks pass walks the timeline once per virtual stage), --ascii and --cores below --pp
    # simulate action by action: each was still running after 60 s
    proc = subprocess.run([sys.executable, "-m", "hpcpipe.simulate", *argv], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and proc.stderr.count("error:") == 1 and words in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv, words", [(["--costs", "-1,2,1,0"], "--costs expects 2 to 4 finite non-negative"),
                                         (["--tp", "2", "--tp-comm", "-1,0"], "--tp-comm expects two finite")])
def test_a_negative_cost_is_named_not_taken_for_an_option(capsys, argv, words):
    # argparse read "-1,2,1,0" as an option: "argument --costs: expected one argument" and the usage
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert words in err and "expected one argument" not in err and err.count("error:") == 1


def test_the_largest_simulation_allowed_still_runs():
    # the bound leaves the sizes a user plans with: 3000 stages x 3000 micro-batches took 3.9 s
    assert main(["--schedule", "gpipe", "--pp", "1000", "--micro-batches", "1000", "--no-validate"]) == 0


def test_a_plot_path_whose_folder_refuses_a_file_is_one_line_before_simulating(capsys):
    # as root /proc passes os.access(W_OK); matplotlib's FileNotFoundError came as a traceback after the results
    pytest.importorskip("matplotlib")
    assert main(["--pp", "4", "--micro-batches", "8", "--plot", "/proc/hpcpipe-x.png"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("error:") == 1 and "'/proc/hpcpipe-x.png'" in err and "Traceback" not in err


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_shared_cores(name, v):
    from hpcpipe.schedule.event_sim import _simulate_shared
    p, m = 4, 8
    shape = shape_of(name, p, m, v)
    programs = lower(build_schedule(name, p, m, v), shape)
    costs = Costs(1, 2, 1, 0.25, 0.5)
    alone = simulate(programs, shape, costs)
    # enough cores: the time-ordered simulation agrees with the per-rank one
    same = _simulate_shared(programs, p, costs, cores=p)
    assert same.step_time == pytest.approx(alone.step_time)
    assert same.peak_stashed == alone.peak_stashed
    # one core: the step is all the work in sequence (messages overlap with others' compute)
    one = simulate(programs, shape, costs, cores=1)
    assert one.step_time == pytest.approx(sum(alone.busy) + p * costs.step, rel=0.02)
    two = simulate(programs, shape, costs, cores=2)
    assert alone.step_time <= two.step_time <= one.step_time


def test_calibrated_costs_rescale_to_other_stage_counts(tmp_path):
    from hpcpipe.schedule.calibrate import calibrated_costs
    path = _fake_trace(tmp_path / "t.json")     # 2 stages
    same = calibrated_costs(path, 2)
    assert same.per_stage and same.forward == pytest.approx(0.01)
    four = calibrated_costs(path, 4)
    assert not four.per_stage and four.forward == pytest.approx(0.005) and four.backward == pytest.approx(0.01)
    chunks = calibrated_costs(path, 2, 2)
    assert chunks.forward == pytest.approx(0.005)


def test_costs_prefer_cpu_time_over_wall_time(tmp_path):
    events = [{"name": "s0F0", "cat": "F", "ph": "X", "ts": 0, "dur": 4000, "pid": 0, "tid": 0,
               "args": {"stage": 0, "mb": 0, "step": 0, "cpu_us": 1000}},
              {"name": "s0B0", "cat": "B", "ph": "X", "ts": 4000, "dur": 2000, "pid": 0, "tid": 0,
               "args": {"stage": 0, "mb": 0, "step": 0}}]
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": events}))
    costs = costs_from_trace(str(path))
    assert costs.forward == pytest.approx(0.001)   # the rank was descheduled 3 of its 4 ms
    assert costs.backward == pytest.approx(0.002)  # no CPU time recorded: wall time


def test_interleaved_peak_activations_formula():
    for p in range(1, 9):
        for v in (2, 3):
            for m in (p, 2 * p, 4 * p):
                peaks = simulate_schedule("interleaved-1f1b", p, m, v).peak_stashed
                assert peaks == [min((p - r - 1) * 2 + (v - 1) * p + 1, v * m) for r in range(p)], (p, m, v)

def test_tensor_parallel_costs_split_compute_and_add_the_collectives():
    """tp ranks divide every action's compute and add their collectives to F, B and I (not W); the step follows."""
    from hpcpipe.schedule.costs import Costs
    from hpcpipe.schedule.event_sim import simulate_schedule

    base = Costs(forward=2.0, backward=4.0, weight=2.0, per_stage={("F", 1): 4.0})
    split = base.tensor_parallel(2, forward_comm=0.25, backward_comm=0.5)
    assert (split.forward, split.backward, split.weight) == (1.25, 2.5, 1.0)
    assert split.of("I", 0) == 1.5 and split.of("W", 0) == 1.0 and split.of("F", 1) == 2.25
    one = simulate_schedule("1f1b", 2, 8, costs=Costs(2.0, 4.0, 2.0), events=False).step_time
    two = simulate_schedule("1f1b", 2, 8, costs=Costs(2.0, 4.0, 2.0).tensor_parallel(2), events=False).step_time
    assert two == pytest.approx(one / 2)
    slow = simulate_schedule("1f1b", 2, 8, costs=Costs(2.0, 4.0, 2.0).tensor_parallel(2, 1.0, 1.0),
                             events=False).step_time
    assert slow == pytest.approx(one / 2 + 2.0 * (8 + 1))   # (F + B) comm per micro-batch on the critical path
    with pytest.raises(ValueError):
        base.tensor_parallel(0)


@pytest.mark.parametrize("costs, option", [("inf,1", "--costs"), ("nan,1", "--costs"), ("1,2,nan", "--costs"),
                                           ("nan,1", "--tp-comm"), ("1,inf", "--tp-comm")])
def test_non_finite_costs_are_one_line_exit_2(capsys, costs, option):
    """--costs inf,1 ended in a ValueError traceback; nan,1 printed a step time of nan (exit 0)."""
    argv = ["--costs", costs] if option == "--costs" else ["--tp", "2", "--tp-comm", costs]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hpcpipe: error: {option} expects") and "finite" in err and err.count("\n") == 1, err


BAD_TRACES = [
    ([1, 2], "traceEvents[0] is int, not an event object"),
    ({"traceEvents": {}}, "is not a Chrome trace"),
    ({"traceEvents": []}, None),
    ({"traceEvents": [{"ph": "X", "cat": "F", "ts": "x", "dur": 1, "tid": 0}]}, "traceEvents[0] has ts = 'x'"),
    ({"traceEvents": [{"ph": "X", "cat": "F", "ts": 0, "tid": 0}]}, "traceEvents[0] has dur = None"),
    ({"traceEvents": [{"ph": "X", "cat": "F", "ts": 0, "dur": -1, "tid": 0}]}, "has dur = -1"),
    ({"traceEvents": [{"ph": "X", "cat": "F", "ts": 1e308, "dur": 1e308, "tid": 0}]}, "end at a finite time"),
    ({"traceEvents": [{"ph": "X", "cat": "F", "ts": 0, "dur": 1}]}, "has tid = None"),
    ({"traceEvents": [{"ph": "X", "cat": "F", "ts": 0, "dur": 1, "tid": 0, "args": []}]}, "has args = []"),
    ({"traceEvents": [{"ph": "X", "cat": "F", "ts": 0, "dur": 1, "tid": 0, "args": {"step": "1"}}]},
     "has args.step = '1'"),
    ({"traceEvents": [{"ph": "X", "cat": 7, "ts": 0, "dur": 1, "tid": 0}]}, "has cat = 7"),
]


@pytest.mark.parametrize("trace, words", BAD_TRACES)
@pytest.mark.parametrize("option", ["--measured", "--calibrate"])
def test_a_malformed_trace_is_one_line_exit_2_not_a_traceback(tmp_path, capsys, trace, words, option):
    """--measured / --calibrate on a trace with a wrong structure ended in KeyError, AttributeError or
    IndexError tracebacks (exit 1)."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    assert main([option, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcpipe: error: trace ") and err.count("\n") == 1, err
    if words:
        assert words in err, err


def test_a_real_training_trace_still_reads(tmp_path, capsys):
    path = _fake_trace(tmp_path / "t.json")
    assert main(["--measured", path]) == 0
    assert main(["--calibrate", path, "--pp", "2"]) == 0


@pytest.mark.parametrize("option", ["--measured", "--calibrate"])
def test_a_trace_that_is_a_named_pipe_or_a_directory_is_one_line_not_a_wait(tmp_path, capsys, option):
    """Opening a named pipe for reading waits for a writer: simulate waited for good."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name, kind in (("fifo", "a named pipe"), ("dir", "a directory")):
        codes: list = []
        argv = [option, str(tmp_path / name)]
        worker = threading.Thread(target=lambda out=codes, a=argv: out.append(main(a)), daemon=True)
        worker.start()
        worker.join(60)                 # a millisecond; before the fix, never (for the pipe)
        assert codes == [2], f"simulate {option} {name} did not return 2 within 60 s: {codes}"
        err = capsys.readouterr().err
        assert err == f"hpcpipe: error: trace '{tmp_path / name}' is {kind}, not a regular file\n", err
