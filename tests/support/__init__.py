"""What the tests share, imported as ``from support.launch import ...`` (tests/ is on sys.path: the root conftest.py).

    launch             start the real commands (under the launcher HPCPIPE_TEST_LAUNCHER names, see launchers), check
                       a refusal's one error line, find the processes a run left behind
    launchers          which launcher the end-to-end tests use (HPCPIPE_TEST_LAUNCHER=mpich|openmpi)
    configs            --set arguments and config sections
    training           sub-communicators, seed-example data, a Trainer on a communicator, the MLP's JAX reference
    state              the checkpoint command, checkpoint contents, file trees, corrupted files, a small tmpfs
    plan               a profile with chosen costs
    serve              small GPT weights, `generate` and a running `serve`
    prometheus_text    a strict parser of the metrics text
    hf                 tiny transformers models and tokenizers made in the test
    timelines          the per-action verdict on a timeline, and timelines mutated at random
    gpt_reference      the GPT in JAX, written from the contract
    llama_reference    the Llama in PyTorch float64, written from the contract
    schedule_reference the Action-list schedule generators as they were before the timeline form

ROOT is the repository; DATA the fixtures written by earlier versions (tests/data/README.md).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
