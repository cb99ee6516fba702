"""`--resume` continues under the run's own saved config, the command line's keys on top (issue #32).

A bare `--resume` used to build the config from the embedded defaults: a run started with its own model,
layout and step count went on (or was refused) under another. Now the checkpoint's manifest's config is
the base, what the command line gives replaces its keys, one line (stderr) names what differs, and a
layout given anew still reshards the checkpoint.
"""

from __future__ import annotations

import json
import sys
import tomllib

from support.configs import sets
from support.launch import run, run_command

from hpcpipe.config import Config, from_dict
from hpcpipe.state import directory_protocol as cf

STARTED = {"model": {"dims": [8, 6, 6, 8]}, "parallel": {"dp": 1, "pp": 2},
           "data": {"synthetic_samples": 32}, "log": {"progress": False},
           "train": {"steps": 2, "micro_batches": 2, "micro_batch_size": 2, "optimizer": "adam"},
           "checkpoint": {"every": 1, "keep": 1}}


def _start(tmp_path):
    """Train STARTED for 2 steps on 2 ranks into tmp_path/ck; return that checkpoint root."""
    root = tmp_path / "ck"
    proc = run_command(2, "hpcpipe.train", sets(**STARTED) + ["--set", f"checkpoint.dir=\"{root}\""], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return root


def _notes(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hpcpipe: resuming ")]


def test_a_bare_resume_continues_under_the_runs_own_config(tmp_path):
    root = _start(tmp_path)
    # only where the checkpoints are and how far to go: model, layout, optimizer and data come from the run
    proc = run_command(2, "hpcpipe.train", ["--set", f"checkpoint.dir=\"{root}\"", "--set", "train.steps=4",
                                            "--resume"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "trained 2 steps (resumed at step 2)" in proc.stdout and "dp=1 pp=2 schedule=gpipe" in proc.stdout
    step = root / "run-0001" / cf.step_name(2)
    assert _notes(proc.stderr) == [f"hpcpipe: resuming {str(step)!r} with its run's saved config, except "
                                   f"train.steps 2 -> 4"]
    manifest = json.loads((root / cf.read_latest(root) / cf.MANIFEST).read_text())
    assert manifest["step"] == 4 and manifest["config"]["model"]["dims"] == [8, 6, 6, 8]
    assert manifest["config"]["data"]["synthetic_samples"] == 32 and manifest["config"]["train"]["steps"] == 4


def test_a_new_layout_on_the_command_line_still_reshards(tmp_path):
    root = _start(tmp_path)
    # pp given anew: the saved dp (1, for the old pipeline) gives way to "auto" = 2 replicas
    proc = run_command(2, "hpcpipe.train", ["--set", f"checkpoint.dir=\"{root}\"", "--set", "train.steps=3",
                                            "--set", "parallel.pp=1", "--resume"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "dp=2 pp=1 schedule=gpipe" in proc.stdout and "(resumed at step 2)" in proc.stdout
    note = _notes(proc.stderr)
    assert len(note) == 1 and note[0].endswith("except parallel.pp 2 -> 1, parallel.dp 1 -> 'auto', "
                                               "train.steps 2 -> 3"), note
    # nothing differs: said so
    again = run_command(2, "hpcpipe.train", ["--set", f"checkpoint.dir=\"{root}\"", "--set", "train.steps=4",
                                             "--set", "parallel.pp=1", "--resume"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert _notes(again.stderr)[0].endswith("except train.steps 3 -> 4")


def test_a_saved_layout_that_does_not_fit_the_world_says_where_it_came_from(tmp_path):
    root = _start(tmp_path)
    proc = run_command(4, "hpcpipe.train", ["--set", f"checkpoint.dir=\"{root}\"", "--set", "train.steps=3",
                                            "--resume"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpcpipe: error:")]
    assert errors == ["hpcpipe: error: world size 4 does not equal parallel.dp (1) x parallel.pp (2) = 2 (resuming: "
                      "the layout is the run's saved one where the command line does not give it; --set "
                      "parallel.pp=N on the command line reshards the checkpoint)"], proc.stderr


def test_print_config_shows_what_a_resume_would_run_without_mpi(tmp_path):
    root = _start(tmp_path)
    proc = run([sys.executable, "-m", "hpcpipe.train", "--print-config", "--resume",
                "--set", f"checkpoint.dir=\"{root}\"", "--set", "train.lr=0.5"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    shown = tomllib.loads(proc.stdout)
    assert shown["model"]["dims"] == [8, 6, 6, 8] and shown["parallel"]["pp"] == 2 and shown["train"]["steps"] == 2
    assert shown["train"]["lr"] == 0.5 and shown["checkpoint"]["resume"] is True
    assert "hpcpipe: MPI:" not in proc.stdout


def test_the_saved_config_is_the_base_and_the_command_line_wins():
    from hpcpipe.train.resume_config import differences, known_keys, merged

    saved = {"parallel": {"pp": 4, "dp": 2, "stage_layers": [1, 1, 1, 1], "virtual_stages": 1},
             "model": {"kind": "mlp", "dims": [8, 8, 8, 8, 8]}, "train": {"steps": 100, "lr": 0.1},
             "gone": {"old_key": 1}}
    saved = known_keys({**saved, "train": {**saved["train"], "removed_since": 3}})
    assert "gone" not in saved and "removed_since" not in saved["train"]
    assert merged(saved, {"train": {"steps": 200}}) == {**saved, "train": {"steps": 200, "lr": 0.1}}
    # a new pp drops the saved dp and cut (they described the old pipeline); given with it, they stay
    assert merged(saved, {"parallel": {"pp": 2}})["parallel"] == {"pp": 2, "virtual_stages": 1}
    assert merged(saved, {"parallel": {"pp": 2, "dp": 4}})["parallel"] == {"pp": 2, "dp": 4, "virtual_stages": 1}
    assert merged(saved, {"parallel": {"virtual_stages": 2}})["parallel"] == {"pp": 4, "dp": 2, "virtual_stages": 2}
    # another schedule drops the saved virtual stages and cut (zb-v's 2 under 1f1b); the same one keeps them
    zbv = {**saved, "parallel": {**saved["parallel"], "schedule": "zb-v", "virtual_stages": 2}}
    assert merged(zbv, {"parallel": {"schedule": "1f1b"}})["parallel"] == {"pp": 4, "dp": 2, "schedule": "1f1b"}
    assert merged(zbv, {"parallel": {"schedule": "zb-v"}})["parallel"] == zbv["parallel"]
    # another model kind: the saved model keys go, so the refusal names the kinds
    assert merged(saved, {"model": {"kind": "gpt"}})["model"] == {"kind": "gpt"}
    gpt = {**saved, "model": {"kind": "gpt", "d_model": 16}}
    assert merged(gpt, {"model": {"dims": [4, 4]}})["model"] == {"dims": [4, 4]}       # an MLP's key: an MLP
    assert merged(gpt, {"model": {"d_model": 8}})["model"] == {"kind": "gpt", "d_model": 8}
    config = from_dict(merged(saved, {"train": {"steps": 200}, "checkpoint": {"resume": True}}))
    assert isinstance(config, Config) and differences(saved, config) == ["train.steps 100 -> 200"]


def test_resuming_under_another_schedule_drops_the_saved_virtual_stages(tmp_path):
    """A zb-v run (virtual_stages = 2) resumed with --set parallel.schedule="1f1b" was refused: '1f1b runs one
    stage per rank (virtual stages: 2)', a value the command line never gave."""
    root = tmp_path / "ck"
    started = {**STARTED, "model": {"dims": [8, 6, 6, 6, 8]},
               "parallel": {"dp": 1, "pp": 2, "schedule": "zb-v", "virtual_stages": 2}}
    proc = run_command(2, "hpcpipe.train", sets(**started) + ["--set", f"checkpoint.dir=\"{root}\""], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = run_command(2, "hpcpipe.train", ["--set", f"checkpoint.dir=\"{root}\"", "--set", "train.steps=3",
                                            "--set", 'parallel.schedule="1f1b"', "--resume"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "(resumed at step 2)" in proc.stdout and "dp=1 pp=2 schedule=1f1b stage_layers=[2, 2]" in proc.stdout
    assert _notes(proc.stderr)[0].endswith("except parallel.schedule 'zb-v' -> '1f1b', parallel.virtual_stages 2 -> 1, "
                                           "train.steps 2 -> 3"), proc.stderr


def test_a_resume_whose_checkpoint_cannot_be_read_says_so_not_the_default_layout(tmp_path):
    """A broken root pointer or a missing checkpoint.dir fell back to the command line's config, and the embedded
    default's pp = 4 was then refused on 2 ranks: 'world size 2 is not divisible by parallel.pp (4)'."""
    root = _start(tmp_path)
    (root / "latest").write_text("garbage\n")
    proc = run_command(2, "hpcpipe.train", ["--set", f"checkpoint.dir=\"{root}\"", "--resume"], cwd=tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpcpipe: error:")]
    assert proc.returncode == 2 and errors == [f"hpcpipe: error: checkpoint pointer {str(root / 'latest')!r} holds "
                                               f"'garbage', not a step-NNNNNNNN or run-NNNN/step-NNNNNNNN name"], \
        proc.stderr
    proc = run_command(2, "hpcpipe.train", ["--set", f"checkpoint.dir=\"{tmp_path / 'nope'}\"", "--resume"],
                       cwd=tmp_path)
    assert proc.returncode == 2 and "does not exist: nothing to resume" in proc.stderr, proc.stderr
