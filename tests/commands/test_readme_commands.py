"""The README's Commands section runs top to bottom (issues #32 and #40).

#32: the Commands section's `examples/text_to_hdf5.py` line and the "GPT decoders" section's wrote the same files,
so the second exited 2 (its outputs existed). #40: generate and serve read checkpoints/gpt-text, which only a later
section trained, and the data line wrote data/fortunes/ while configs/gpt-text.toml reads data/text-train.h5. The
data line is now the Commands section's alone; every file a line reads there is written by a line above it.
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


def commands_block() -> list[list[str]]:
    """The words of each line of the README's Commands section's code block, comments cut off."""
    text = (ROOT / "README.md").read_text().split("## Commands", 1)[1]
    block = text.split("```", 2)[1]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def _after(words: list[str], flag: str) -> str | None:
    return words[words.index(flag) + 1] if flag in words else None


def made_and_read(words: list[str]) -> tuple[set[str], set[str]]:
    """The data files and checkpoint folders one command line writes, and those it reads."""
    made, read = set(), set()
    if "examples/text_to_hdf5.py" in words:
        out = _after(words, "--out")
        made |= {f"{out}/text-train.h5"} | ({f"{out}/text-test.h5"} if "--held-out" in words else set())
    elif "examples/digits_to_hdf5.py" in words:
        out = _after(words, "--out") or "data"
        made |= {f"{out}/digits-train.h5", f"{out}/digits-test.h5"}
    elif "hpcpipe.train" in words and "--config" in words and "--print-config" not in words:
        config = tomllib.loads((ROOT / _after(words, "--config")).read_text())
        if "path" in config.get("data", {}):
            read.add(config["data"]["path"])
        if "dir" in config.get("checkpoint", {}):
            made.add(config["checkpoint"]["dir"])
    for flag in ("--weights", "--data", "--input"):
        given = _after(words, flag)
        if given is not None and given.startswith(("data/", "checkpoints/")):
            read.add(given)
    return made, read


def test_the_commands_section_reads_only_what_a_line_above_wrote():
    made, missing = set(), []
    for words in commands_block():
        writes, reads = made_and_read(words)
        missing += [f"{' '.join(words[:6])} ... reads {r}" for r in sorted(reads - made)]
        made |= writes
    assert not missing, missing
    assert {"checkpoints/gpt-text", "data/text-train.h5", "checkpoints/digits"} <= made


@pytest.mark.skipif(not FORTUNES.is_dir(), reason="needs Debian's fortunes (apt-get install fortunes)")
def test_the_readme_text_command_writes_what_the_gpt_config_and_evaluate_read(tmp_path):
    lines = readme_lines("python examples/text_to_hdf5.py /usr/share/games/fortunes")
    assert len(lines) == 1, lines                  # one line: running the README twice over never collides
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    words = shlex.split(lines[0])
    words[0] = sys.executable
    proc = subprocess.run(words, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert proc.returncode == 0, (lines[0], proc.stderr)
    out = words[words.index("--out") + 1]
    reads = tomllib.loads((ROOT / "configs" / "gpt-text.toml").read_text())["data"]["path"]
    assert reads == f"{out}/text-train.h5" and (tmp_path / reads).is_file()
    assert (tmp_path / out / "text-test.h5").is_file()       # what the evaluate line reads
    assert f"--data {out}/text-test.h5" in (ROOT / "README.md").read_text()
