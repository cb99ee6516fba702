"""Which existing files an output may replace (hpcpipe.state.outputs): only hpcpipe's own earlier output."""

import io
import json
import os

import h5py
import numpy as np
import pytest

from hpcpipe.errors import ConfigError
from hpcpipe.state.outputs import (
    INFER_FORMAT,
    check_replaceable,
    check_writable,
    commit_output,
    dump_marked_json,
    marked_json,
    write_json_output,
)
from hpcpipe.train.preflight import check_log_files, check_metrics_file


def test_the_writer_mark_comes_first_and_reads_back_as_json():
    buf = io.StringIO()
    dump_marked_json({"rows": 3, "writer": "someone"}, buf, "report")
    assert buf.getvalue().startswith('{"writer": "hpcpipe.infer.report", ')
    assert json.loads(buf.getvalue()) == {"writer": "hpcpipe.infer.report", "rows": 3}
    assert list(marked_json({"a": 1}, "trace")) == ["writer", "a"]
    with pytest.raises(ValueError, match="unknown JSON output kind"):
        marked_json({}, "json")


def test_a_missing_path_or_an_earlier_output_of_the_same_kind_may_be_replaced(tmp_path):
    check_replaceable(tmp_path / "new.h5", "infer", "output path")
    out = tmp_path / "out.h5"
    with h5py.File(out, "w") as f:
        f.attrs["format"] = INFER_FORMAT
        f["y"] = np.zeros((2, 2))
    check_replaceable(out, "infer", "output path")
    trace = tmp_path / "trace.json"
    write_json_output(trace, {"traceEvents": []}, "trace", "trace path")
    check_replaceable(trace, "trace", "trace path")
    write_json_output(trace, {"traceEvents": [1]}, "trace", "trace path")      # a rerun replaces its own
    assert json.loads(trace.read_text())["traceEvents"] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.h5", "trace.json"]   # no temporary left


@pytest.mark.parametrize("make,kind,words", [
    (lambda p: p.write_text("notes\n"), "trace", "already exists and is not a file hpcpipe wrote as a trace"),
    (lambda p: p.write_text('{"traceEvents": []}'), "trace", "already exists and is not"),
    # another kind of hpcpipe output: a report never replaces a trace (or a generation result)
    (lambda p: p.write_text('{"writer": "hpcpipe.trace", "traceEvents": []}'), "report",
     "is not a file hpcpipe wrote as a report"),
    (lambda p: p.write_text('{"writer": "hpcpipe.traced", "mine": 1}'), "trace", "already exists and is not"),
    (lambda p: p.write_text('{"writer": "hpcpipe.infer.report"}'), "infer", "is not an hpcpipe.infer output"),
    (lambda p: p.write_bytes(b""), "generate", "already exists and is not"),
    (lambda p: p.mkdir(), "trace", "exists and is not a regular file"),
    (lambda p: p.symlink_to(p.with_name("elsewhere")), "trace", "is a symbolic link"),
])
def test_anything_else_is_refused_and_left_alone(tmp_path, make, kind, words):
    path = tmp_path / "target"
    make(path)
    with pytest.raises(ConfigError, match="target") as err:
        check_replaceable(path, kind, "report path")
    assert words in str(err.value) and str(err.value).startswith(f"report path {str(path)!r}")
    assert path.exists() or path.is_symlink()


def test_a_file_that_appears_during_the_run_is_left_alone_and_the_result_kept(tmp_path):
    final, tmp = tmp_path / "out.json", tmp_path / ".out.json.tmp-1"
    tmp.write_text('{"writer": "hpcpipe.trace"}')
    final.write_text("written by someone while the run computed\n")     # checked free at start, taken now
    with pytest.raises(ConfigError, match="already exists and is not") as err:
        commit_output(tmp, final, "trace", "trace path")
    assert "this run's result is kept as" in str(err.value) and str(tmp) in str(err.value)
    assert final.read_text() == "written by someone while the run computed\n" and tmp.exists()
    with pytest.raises(ConfigError, match="appeared while the run was writing"):
        commit_output(tmp, final, None, "export output")               # export: never replaces anything
    final.unlink()
    commit_output(tmp, final, None, "export output")                   # free: taken by a hard link
    assert final.read_text() == '{"writer": "hpcpipe.trace"}' and not tmp.exists()


def test_an_hdf5_file_of_another_format_is_not_an_inference_output(tmp_path):
    path = tmp_path / "data.h5"
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "something-else"
        f["x"] = np.zeros(3)
    with pytest.raises(ConfigError, match="is not an hpcpipe.infer output"):
        check_replaceable(path, "infer", "output path")
    with pytest.raises(ValueError, match="unknown output kind"):
        check_replaceable(path, "weights", "output path")


@pytest.mark.parametrize("make,words", [
    (lambda p: p.write_text('{"name": "my-app", "version": "1.0"}\n'), "is not a metrics file"),   # was appended to
    (lambda p: p.write_text('{"text": "a dataset line"}\n{"text": "another"}\n'), "is not a metrics file"),
    (lambda p: p.symlink_to(p.with_name("real.jsonl")), "is a symbolic link"),
    (lambda p: os.mkfifo(p), "is not a regular file"),                   # was: the open blocked for ever
])
def test_metrics_are_appended_only_to_an_earlier_runs_metrics(tmp_path, make, words):
    (tmp_path / "real.jsonl").write_text('{"step": 0, "loss": 1.0, "step_time_s": 0.1}\n')
    check_metrics_file(str(tmp_path / "real.jsonl"))
    path = tmp_path / "m.jsonl"
    make(path)
    with pytest.raises(ConfigError, match=words):
        check_metrics_file(str(path))


def test_metrics_and_trace_hard_linked_to_one_file_are_refused(tmp_path):
    from hpcpipe.config import from_dict
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("")
    os.link(metrics, tmp_path / "t.json")
    config = from_dict({"log": {"metrics": str(metrics), "trace": str(tmp_path / "t.json")},
                        "checkpoint": {"dir": ""}})
    with pytest.raises(ConfigError, match="are the same file"):
        check_log_files(config, None, None)


@pytest.mark.parametrize("key", ["metrics", "trace"])
def test_a_log_file_in_a_folder_that_refuses_files_is_refused_before_training(key):
    # as root /proc passes the permission bits: log.metrics = "/proc/x" was a FileNotFoundError traceback from rank 0
    # at step 0 (exit 1), log.trace = "/proc/x" a warning after training ("trace not written")
    from hpcpipe.config import from_dict
    config = from_dict({"log": {key: "/proc/hpcpipe-x.json"}, "checkpoint": {"dir": ""}})
    with pytest.raises(ConfigError, match=f"log.{key} '/proc/hpcpipe-x.json': cannot create a file in '/proc'"):
        check_log_files(config, None, None)


@pytest.mark.parametrize("name,words", [
    ("", "--json path is empty: name the file to write"),
    ("nodir/x.json", "--json directory '{tmp}/nodir' does not exist (for --json '{tmp}/nodir/x.json')"),
    ("notes.txt/x.json", "--json path '{tmp}/notes.txt/x.json' is not writable: '{tmp}/notes.txt' is not a directory"),
    ("fifo", "--json path '{tmp}/fifo' exists and is a named pipe, not a regular file; choose another path"),
    (".", "--json path '{tmp}' is a directory"),
])
def test_an_output_path_that_cannot_take_a_file_is_named_for_what_it_is(tmp_path, name, words):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "notes.txt").write_text("mine\n")
    path = str(tmp_path / name) if name not in ("", ".") else ("" if not name else str(tmp_path))
    with pytest.raises(ConfigError) as info:
        check_writable(path, "--json path")
    assert str(info.value) == words.format(tmp=tmp_path)
    check_writable(tmp_path / "new.json", "--json path")      # a new name in a writable directory is fine



@pytest.mark.parametrize("length", [243, 255, 300])
def test_a_name_too_long_for_its_temporary_is_refused_before_the_run(tmp_path, length):
    # 243-255 bytes: the name fits, but the temporary beside it (14 bytes longer) would not, and the result
    # was lost at the end of the run; 300: the name itself is too long (was a traceback, ENAMETOOLONG)
    path = tmp_path / ("r" * (length - 5) + ".json")
    with pytest.raises(ConfigError) as info:
        check_writable(path, "--json path")
    text = str(info.value)
    assert text.startswith(f"--json path {str(path)!r}") and "\n" not in text
    assert ("file name is too long" in text) if length <= 255 else ("not usable: File name too long" in text)
    check_writable(tmp_path / ("r" * 236 + ".json"), "--json path")     # 241 bytes + 14 = 255: still fine
