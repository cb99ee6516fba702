"""The README's `examples/text_to_hdf5.py` lines run as printed, one after the other (issue #32).

The Commands section's line and the "GPT decoders" section's wrote the same files, so the second exited 2
(its outputs existed). Each line is copied from README.md literally and run in a fresh directory, in the
README's order; the one the GPT section trains from writes what configs/gpt-text.toml reads.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from support import ROOT

FORTUNES = Path("/usr/share/games/fortunes")


def readme_lines(start: str) -> list[str]:
    """README.md's command lines that start with ``start``, in order, without their trailing comments."""
    lines = []
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith(start):
            lines.append(line.split("   #")[0].strip())
    return lines


@pytest.mark.skipif(not FORTUNES.is_dir(), reason="needs Debian's fortunes (apt-get install fortunes)")
def test_the_readme_text_commands_run_one_after_the_other(tmp_path):
    lines = readme_lines("python examples/text_to_hdf5.py /usr/share/games/fortunes")
    assert len(lines) == 2, lines
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    outs = []
    for line in lines:
        words = shlex.split(line)
        words[0] = sys.executable
        proc = subprocess.run(words, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
        assert proc.returncode == 0, (line, proc.stderr)
        outs.append(words[words.index("--out") + 1])
    assert len(set(outs)) == 2                     # each writes its own folder
    reads = tomllib.loads((ROOT / "configs" / "gpt-text.toml").read_text())["data"]["path"]
    gpt_section = outs[1]                          # the section that trains configs/gpt-text.toml next
    assert reads == f"{gpt_section}/text-train.h5" and (tmp_path / reads).is_file()
    assert (tmp_path / gpt_section / "text-test.h5").is_file()       # what its evaluate line reads
    assert f"--data {gpt_section}/text-test.h5" in (ROOT / "README.md").read_text()
