"""Learning-rate schedules (issue #38): constant, linear and cosine with warmup (and a cosine floor) equal to
transformers' schedule functions under torch's LambdaLR at every step of a 100-step run, in the metrics of a real
run, and the same sequence after a resume at step 37 at another layout; bad keys are one line, exit 2."""

from __future__ import annotations

import json

import pytest
from support.configs import sets
from support.launch import one_error, run_command

from hpcpipe.config import from_dict
from hpcpipe.errors import ConfigError
from hpcpipe.train.lr_schedule import lr_at, schedule_warning

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

STEPS, WARMUP, LR = 100, 10, 3e-3


def _torch_rates(schedule: str, steps: int = STEPS, warmup: int = WARMUP, min_ratio: float = 0.0) -> list[float]:
    """The rate each of `steps` optimizer steps uses under transformers' schedule and torch's LambdaLR."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    t = transformers
    if schedule == "constant":
        sched = t.get_constant_schedule_with_warmup(opt, warmup)
    elif schedule == "linear":
        sched = t.get_linear_schedule_with_warmup(opt, warmup, steps)
    elif min_ratio:
        sched = t.get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, steps, min_lr_rate=min_ratio)
    else:
        sched = t.get_cosine_schedule_with_warmup(opt, warmup, steps)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


def _train(schedule: str, min_ratio: float = 0.0, steps: int = STEPS, warmup: int = WARMUP):
    return from_dict({"train": {"lr": LR, "lr_schedule": schedule, "warmup_steps": warmup, "steps": steps,
                                "min_lr_ratio": min_ratio}}).train


@pytest.mark.parametrize("schedule,min_ratio", [("constant", 0.0), ("linear", 0.0), ("cosine", 0.0),
                                                ("cosine", 0.1)])
def test_every_step_equals_transformers_schedule_under_lambda_lr(schedule, min_ratio):
    want = _torch_rates(schedule, min_ratio=min_ratio)
    train = _train(schedule, min_ratio)
    got = [lr_at(train, s) for s in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-12
    assert got[0] == 0.0 and got[WARMUP] == pytest.approx(LR)      # warmup from 0 to the peak at step 10
    if schedule == "cosine":
        assert min(got[WARMUP:]) >= LR * min_ratio - 1e-15


def test_linear_floor_and_no_warmup():
    """min_lr_ratio stops a linear decay at lr x ratio; without warmup the first step uses the whole rate."""
    train = _train("linear", 0.25, warmup=0)
    rates = [lr_at(train, s) for s in range(STEPS)]
    assert rates[0] == LR and rates[-1] == pytest.approx(LR * (0.25 + 0.75 / STEPS))
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    plain = _torch_rates("linear", warmup=0)
    assert [lr_at(_train("linear", warmup=0), s) for s in range(STEPS)] == pytest.approx(plain, abs=1e-15)


def test_warmup_longer_than_the_run_is_a_warning():
    assert schedule_warning(_train("cosine")) is None
    text = schedule_warning(_train("cosine", steps=8))
    assert "train.warmup_steps = 10" in text and "train.steps = 8" in text


@pytest.mark.parametrize("train,words", [
    ({"lr_schedule": "exponential"}, ["train.lr_schedule 'exponential'", "constant, linear, cosine"]),
    ({"warmup_steps": -1}, ["train.warmup_steps must be >= 0"]),
    ({"min_lr_ratio": 1.5, "lr_schedule": "cosine"}, ["train.min_lr_ratio must be in [0, 1]"]),
    ({"min_lr_ratio": 0.1}, ["train.min_lr_ratio = 0.1", "constant"]),
])
def test_bad_schedule_keys_are_refused(train, words):
    with pytest.raises(ConfigError) as info:
        from_dict({"train": train})
    for word in words:
        assert word in str(info.value)


RUN = {"model": {"dims": [8, 8, 8, 8, 8]}, "data": {"synthetic_samples": 64},
       "train": {"steps": STEPS, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adamw", "lr": LR,
                 "lr_schedule": "cosine", "warmup_steps": WARMUP, "min_lr_ratio": 0.1},
       "checkpoint": {"every": 37, "keep": 3}, "log": {"progress": False}}


@pytest.mark.slow
def test_a_run_logs_each_steps_rate_and_a_resume_at_another_layout_continues_it(tmp_path):
    """Steps 0..36 at dp=2 x pp=2, a fault at step 37, --resume at dp=1 x pp=4: the metrics' "lr" of all 100 steps
    are transformers' cosine-with-floor rates."""
    metrics = tmp_path / "m.jsonl"
    common = sets(**RUN) + ["--set", f'checkpoint.dir="{tmp_path / "ck"}"', "--set", f'log.metrics="{metrics}"']
    first = run_command(4, "hpcpipe.train", common + ["--set", "parallel.pp=2"], cwd=tmp_path,
                        env={"HPCPIPE_FAULT": "rank=0,step=37"})
    assert first.returncode == 1, first.stderr
    again = run_command(4, "hpcpipe.train", ["--set", f'checkpoint.dir="{tmp_path / "ck"}"', "--set", "parallel.pp=4",
                                             "--resume"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "dp=1 pp=4" in again.stdout and "(resumed at step 37)" in again.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    by_step = {r["step"]: r["lr"] for r in records}
    assert sorted(by_step) == list(range(STEPS))
    want = _torch_rates("cosine", min_ratio=0.1)
    assert max(abs(by_step[s] - want[s]) for s in range(STEPS)) <= 1e-12


def test_warmup_beyond_the_run_warns_once_and_trains(tmp_path):
    proc = run_command(2, "hpcpipe.train", sets(**{**RUN, "train": {**RUN["train"], "steps": 3}})
                       + ["--set", 'checkpoint.dir=""', "--set", "parallel.pp=2"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("hpcpipe: warning: train.warmup_steps")]
    assert len(warnings) == 1 and "never reaches train.lr" in warnings[0], proc.stderr


def test_a_bad_schedule_on_the_command_line_is_one_line_exit_2(tmp_path):
    proc = run_command(2, "hpcpipe.train", ["--set", 'train.lr_schedule="exp"', "--set", "parallel.pp=2"],
                       cwd=tmp_path)
    one_error(proc, "train.lr_schedule 'exp'")
