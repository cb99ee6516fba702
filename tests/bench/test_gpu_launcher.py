"""The GPU check's mpiexec: the one of the MPI mpi4py loads, not merely the first on PATH."""

import os
import stat
import subprocess
import sys

from support import ROOT, launchers

sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import gpu_common  # noqa: E402  (bench/gpu is not a package)


def _fake_mpiexec(folder):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "mpiexec"
    path.write_text("#!/bin/sh\necho other MPI\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_the_one_beside_python_wins_over_another_mpi_first_on_path(tmp_path, monkeypatch):
    other = _fake_mpiexec(tmp_path / "site-module" / "bin")
    venv_bin = tmp_path / "venv" / "bin"
    beside = _fake_mpiexec(venv_bin)
    monkeypatch.delenv(gpu_common.MPIEXEC_ENV, raising=False)
    monkeypatch.setenv("PATH", f"{os.path.dirname(other)}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    assert gpu_common.mpiexec() == beside
    assert launchers.mpich_mpiexec() == beside


def test_check_sh_s_choice_is_what_every_launch_takes(tmp_path, monkeypatch):
    carried = _fake_mpiexec(tmp_path / "prefix" / "bin")
    monkeypatch.setenv(gpu_common.MPIEXEC_ENV, carried)
    assert gpu_common.mpiexec() == carried
    assert launchers.mpich_mpiexec() == carried


def test_without_one_beside_python_the_first_on_path(tmp_path, monkeypatch):
    on_path = _fake_mpiexec(tmp_path / "mpi" / "bin")
    monkeypatch.delenv(gpu_common.MPIEXEC_ENV, raising=False)
    monkeypatch.setenv("PATH", f"{os.path.dirname(on_path)}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-mpi" / "python"))
    assert gpu_common.mpiexec() == on_path


def test_check_sh_exports_the_mpiexec_beside_its_python(tmp_path):
    """The check's own lines (no wheels carried): a Python whose folder holds an mpiexec, another first on PATH."""
    other = _fake_mpiexec(tmp_path / "other" / "bin")
    pybin = tmp_path / "py" / "bin"
    beside = _fake_mpiexec(pybin)
    script = (ROOT / "bench" / "gpu" / "check.sh").read_text()
    start, end = script.index("# the mpiexec of the MPI mpi4py loads"), script.index('echo "mpiexec: ${MPIEXEC')
    (pybin / "python").symlink_to(sys.executable)    # its sys.executable: the link's path, in pybin
    probe = tmp_path / "probe.sh"
    probe.write_text(f"carried=()\nPREFIX={tmp_path}/none\nPY={pybin}/python\n" + script[start:end]
                     + 'echo "$HPCPIPE_GPU_MPIEXEC"\n')
    env = {**os.environ, "PATH": f"{os.path.dirname(other)}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(probe)], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == beside
