"""A prompt worker: a child process of the HTTP front end that renders chat templates and tokenizes prompts.

    python -m hpcpipe.serve.prompt_worker MEMORY_BYTES      (started by hpcpipe.serve.prompt_pool, not by hand)

Roughly::

    read the tokenizer (one frame) and build it
    cap the address space at what this process maps now + MEMORY_BYTES (RLIMIT_AS: an allocation past it is a
        MemoryError here, answered 400, never the server's problem); no core files
    answer {"ready"}; then per request: read its jobs, run them (hpcpipe.serve.prompt_jobs), answer the results

The parent kills this process when a request passes its time budget (a template's endless loop) and starts
another; a Rust abort here (tokenizers on a huge text) ends only this process. A frame is two little-endian
uint32 lengths, a JSON header and a binary tail (the tokenizer's files; token ids as int64). Answers are JSON and
raw ids, never pickles: the server does not trust what a model's template might make this process say. Nothing
else is written to stdout (it is the protocol), stderr goes nowhere (a Rust panic prints a backtrace there), and
a thread ends the process when its parent is gone, so a killed server leaves no worker behind.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time
import traceback
from typing import IO, Any

import numpy as np

_LENGTHS = struct.Struct("<II")
# below the server's threads and the engine's ranks: on a busy node the event loop (/health) and the decode steps
# get the cores first; tokenizing ten 1 MB prompts is batch work
NICE = 5
IDS = np.dtype("<i8")


def write_frame(out: IO[bytes], header: dict, blob: bytes = b"") -> None:
    """Write one frame (JSON header, binary tail) and flush it."""
    data = json.dumps(header).encode()
    out.write(_LENGTHS.pack(len(data), len(blob)) + data + blob)
    out.flush()


def read_frame(inp: IO[bytes]) -> tuple[dict, bytes] | None:
    """Read one frame from a blocking stream; None at the end of the stream."""
    lengths = inp.read(_LENGTHS.size)
    if len(lengths) < _LENGTHS.size:
        return None
    size, tail = _LENGTHS.unpack(lengths)
    header, blob = inp.read(size), inp.read(tail)
    if len(header) < size or len(blob) < tail:
        return None
    return json.loads(header), blob


def pack_results(results: list[list[int] | str]) -> tuple[dict, bytes]:
    """Return the answer frame of a request's results: texts in the header, every id list in the binary tail."""
    shape = [{"ids": len(r)} if isinstance(r, list) else {"text": r} for r in results]
    ids = [np.asarray(r, dtype=IDS) for r in results if isinstance(r, list)]
    return {"results": shape}, b"".join(a.tobytes() for a in ids)


def unpack_results(header: dict, blob: bytes) -> list[list[int] | str]:
    """Return the results of an answer frame (the parent's side of pack_results)."""
    ids = np.frombuffer(blob, dtype=IDS)
    out, at = [], 0
    for entry in header["results"]:
        if "text" in entry:
            out.append(str(entry["text"]))
        else:
            n = int(entry["ids"])
            out.append(ids[at:at + n].tolist())
            at += n
    if at != len(ids):
        raise ValueError(f"prompt worker: the answer holds {len(ids)} token ids, its header {at}")
    return out


def tokenizer_frame(tokenizer: Any) -> tuple[dict, bytes]:
    """Return the frame that makes a worker build this tokenizer (a Hugging Face one's files, or a bytes/chars one)."""
    files = getattr(tokenizer, "files", None)
    if files is not None:
        names = sorted(files)
        return ({"kind": "hf", "source": getattr(tokenizer, "source", "tokenizer files"),
                 "files": [[name, len(files[name])] for name in names]}, b"".join(files[name] for name in names))
    return {"kind": "json", "json": tokenizer.to_json()}, b""


def build_tokenizer(header: dict, blob: bytes) -> Any:
    """Return the tokenizer a tokenizer_frame describes."""
    if header["kind"] == "hf":
        from hpcpipe.hf.tokenizer import from_files
        files, at = {}, 0
        for name, size in header["files"]:
            files[name], at = blob[at:at + size], at + size
        return from_files(files, header["source"])
    from hpcpipe.state.tokenizer import Tokenizer
    return Tokenizer.from_json(header["json"])


def _cap_memory(extra: int) -> None:
    """Let this process map at most what it maps now plus ``extra`` bytes (never more than the address-space limit it
    was started under), and write no core file when it aborts."""
    import resource
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    # under a job's ulimit -v a limit above its hard one cannot be set: "not allowed to raise maximum limit" stopped
    # every prompt, so generate and serve failed wherever the node's limit was below mapped + extra; the soft one
    # is what the job asked for (never raised)
    cap = min([mapped + extra] + [v for v in resource.getrlimit(resource.RLIMIT_AS) if v != resource.RLIM_INFINITY])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _exit_with_parent(parent: int) -> None:
    """End this process once its parent is gone (the server was killed): nobody will read the answers."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def answer(tokenizer: Any, header: dict, memory: int) -> tuple[dict, bytes]:
    """Run one request's jobs; return its answer frame: the results, or the request's error (status, message)."""
    from hpcpipe.serve.api_error import ApiError
    from hpcpipe.serve.prompt_jobs import run_jobs
    try:
        return pack_results(run_jobs(tokenizer, header["jobs"], header.get("max_chars")))
    except ApiError as exc:
        return {"error": {"status": exc.status, "message": exc.message, "param": exc.param}}, b""
    except MemoryError:
        return {"error": {"status": 400, "param": None, "message": (
            f"preparing the prompt needs more than the prompt worker's {memory >> 20} MiB of memory")}}, b""
    except Exception as exc:  # noqa: BLE001 - a bug of ours: the request fails with a 500, the log gets the trace
        return {"error": {"status": 500, "param": None, "message": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()}}, b""


def main(argv: list[str]) -> int:
    """Serve requests read from stdin until it closes; return the exit status."""
    memory = int(argv[0])
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr                 # a stray print must not corrupt the protocol
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    os.nice(NICE)
    frame = read_frame(inp)
    if frame is None:
        return 0
    try:
        tokenizer = build_tokenizer(*frame)
        _cap_memory(memory)
    except Exception as exc:  # noqa: BLE001 - the parent says why the server cannot start
        write_frame(out, {"error": {"status": 500, "param": None, "message": f"{type(exc).__name__}: {exc}"}})
        return 1
    write_frame(out, {"ready": True})
    while (frame := read_frame(inp)) is not None:
        write_frame(out, *answer(tokenizer, frame[0], memory))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
