"""Which existing files an output may replace (hpcpipe.state.own_output): only hpcpipe's own earlier output."""

import io
import json

import h5py
import numpy as np
import pytest

from hpcpipe.errors import ConfigError
from hpcpipe.state.own_output import INFER_FORMAT, check_replaceable, dump_marked_json, marked_json
from hpcpipe.trace import write_json


def test_the_writer_mark_comes_first_and_reads_back_as_json():
    buf = io.StringIO()
    dump_marked_json({"rows": 3, "writer": "someone"}, buf, "hpcpipe.infer")
    assert buf.getvalue().startswith('{"writer": "hpcpipe.infer", ')
    assert json.loads(buf.getvalue()) == {"writer": "hpcpipe.infer", "rows": 3}
    assert list(marked_json({"a": 1})) == ["writer", "a"]
    with pytest.raises(ValueError, match="must start with 'hpcpipe'"):
        marked_json({}, "other")


def test_a_missing_path_or_an_earlier_hpcpipe_output_may_be_replaced(tmp_path):
    check_replaceable(tmp_path / "new.h5", "infer", "output path")
    out = tmp_path / "out.h5"
    with h5py.File(out, "w") as f:
        f.attrs["format"] = INFER_FORMAT
        f["y"] = np.zeros((2, 2))
    check_replaceable(out, "infer", "output path")
    report = tmp_path / "report.json"
    write_json(str(report), {"traceEvents": []})
    check_replaceable(report, "json", "trace path")


@pytest.mark.parametrize("make,kind,words", [
    (lambda p: p.write_text("notes\n"), "json", "already exists and is not a JSON file hpcpipe wrote"),
    (lambda p: p.write_text('{"traceEvents": []}'), "json", "already exists and is not a JSON file hpcpipe wrote"),
    (lambda p: p.write_text('{"writer": "hpcpipe.infer"}'), "infer", "already exists and is not an hpcpipe.infer"),
    (lambda p: p.write_bytes(b""), "json", "already exists and is not"),
    (lambda p: p.mkdir(), "json", "exists and is not a regular file"),
    (lambda p: p.symlink_to(p.with_name("elsewhere")), "json", "is a symbolic link"),
])
def test_anything_else_is_refused_and_left_alone(tmp_path, make, kind, words):
    path = tmp_path / "target"
    make(path)
    with pytest.raises(ConfigError, match="target") as err:
        check_replaceable(path, kind, "report path")
    assert words in str(err.value) and str(err.value).startswith(f"report path {str(path)!r}")
    assert path.exists() or path.is_symlink()


def test_an_hdf5_file_of_another_format_is_not_an_inference_output(tmp_path):
    path = tmp_path / "data.h5"
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "something-else"
        f["x"] = np.zeros(3)
    with pytest.raises(ConfigError, match="is not an hpcpipe.infer output"):
        check_replaceable(path, "infer", "output path")
    with pytest.raises(ValueError, match="unknown output kind"):
        check_replaceable(path, "weights", "output path")
