"""``python -m hpcpipe.checkpoint verify|export|info|import``: check, flatten, describe or convert stored state.

    python -m hpcpipe.checkpoint verify PATH         # manifest, sizes, SHA-256, shapes, checksums; exit 1: bad file
    python -m hpcpipe.checkpoint export PATH out.h5  # one weights file holding every layer
    python -m hpcpipe.checkpoint export PATH DIR --format hf   # a Hugging Face directory transformers loads
    python -m hpcpipe.checkpoint export PATH DIR --format peft # a LoRA run's adapters as a PEFT directory
    python -m hpcpipe.checkpoint export PATH OUT --merge-adapter   # a LoRA run's model, adapters merged (any format)
    python -m hpcpipe.checkpoint import HF_DIR out.h5          # a Hugging Face model as one weights file
    python -m hpcpipe.checkpoint info PATH           # runs, step, layout, optimizer, files (or a weights file's layers)

PATH is a checkpoint root (its ``latest`` is followed into the run that
wrote it), a run directory, a ``step-NNNNNNNN`` directory, a ``latest``
pointer file, or (verify, info, export) a single weights file. Nothing here
uses MPI: reading is :mod:`hpcpipe.state.sources`, the directory protocol
:mod:`hpcpipe.state.directory_protocol`, what makes a checkpoint valid
:mod:`hpcpipe.state.manifest`, the collective save and load
:mod:`hpcpipe.state.collective`.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
from pathlib import Path

from hpcpipe.cli import CommandParser, reader_left
from hpcpipe.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, ConfigError, UsageError
from hpcpipe.h5files import member
from hpcpipe.lazy_h5py import h5py
from hpcpipe.runtime.launcher import launcher_rank, one_process_problem
from hpcpipe.state import directory_protocol as cf
from hpcpipe.state.adapters import check_peft_exportable, export_peft, exported_source
from hpcpipe.state.child_write import Stopped, WriteFailed, signals_held, write_in_child
from hpcpipe.state.describe import describe_adapter, lora_lines
from hpcpipe.state.hdf5_source import HDF5Source, checkpoint_source
from hpcpipe.state.hf_convert import OutOfRange, check_hf_exportable, check_new_directory, export_hf, import_hf
from hpcpipe.state.hf_source import hf_source
from hpcpipe.state.kinds import count_text, shape_text
from hpcpipe.state.outputs import check_writable, commit_output
from hpcpipe.state.peft import CONFIG as ADAPTER_CONFIG
from hpcpipe.state.root_latest import lagging_root
from hpcpipe.state.sources import protected_paths, refuse_overwrite, resolve_step_dir, resolve_weights
from hpcpipe.state.verify import hf_directory, verify
from hpcpipe.state.weights import (
    layer_group,
    members,
    open_checked,
    stored_layers,
    write_weights,
)
from hpcpipe.state.weights_source import WeightsSource


def _describe_hf(path: Path) -> list[str]:
    """Lines about a Hugging Face model directory: its model, weights files and tokenizer."""
    source = hf_source(path)
    model, tokenizer = _model_lines(source)
    tensors = source.tensors
    files = sorted(set(tensors.weight_map.values()))
    size = sum((path / name).stat().st_size for name in files)
    return [f"Hugging Face model directory {str(path)!r} (model_type {source.hf.model_type}, not a checkpoint): "
            f"{model}", f"  dtype {source.hf.dtype or 'not stated'}; {len(tensors.weight_map)} tensors in "
            f"{', '.join(files) if len(files) <= 3 else f'{len(files)} safetensors shards'} ({size} bytes)",
            *tokenizer]


def export(path: str | Path, out: str | Path, with_optimizer: bool = False, merge: bool = False) -> WeightsSource:
    """Write every layer of a checkpoint (or weights file) into one weights file, atomically (``merge``: a LoRA
    run's checkpoint with its adapters merged, hpcpipe.state.adapters)."""
    source = exported_source(resolve_weights(path), merge)
    indices = list(range(source.n_layers))
    arrays = source.read(indices)
    optimizer, attrs = None, None
    if with_optimizer and source.kind == "checkpoint":
        attrs, optimizer = source.read_optimizer(indices)
    tokenizer = source.tokenizer()
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")   # never a name a user file could have

    def write() -> None:
        write_weights(tmp, arrays, n_layers=source.n_layers, model_config=source.model, step=source.step,
                      optimizer=optimizer, optimizer_attrs=attrs, tokenizer=tokenizer)
        cf.fsync_path(tmp)

    # HDF5 after a failed write (a full disk) crashes its process: the child's, and tmp is removed
    write_in_child(tmp, write, f"export output {str(out)!r}")
    with signals_held():
        commit_output(tmp, out, None, "export output")   # a refusal keeps the result at tmp and says so
    return source


def _merge_error(args) -> str | None:
    """Why a LoRA run's checkpoint cannot be exported as asked (None if it can): a usage error, status 2."""
    try:
        exported_source(resolve_weights(args.dir), args.merge_adapter)
        if args.merge_adapter and args.optimizer:
            raise ConfigError("--merge-adapter writes a model; its adapters' optimizer state (--optimizer) has no "
                              "place in it")
    except ConfigError as exc:
        return str(exc)
    return None


def export_output_error(out: str, protected: tuple | None = None) -> str | None:
    """Why ``out`` cannot take an export (None if it can): the path alone, or with (files, dirs) it must spare."""
    try:
        if protected is None:
            if out.endswith("/"):
                raise ConfigError(f"export output {out!r} is a directory; name the weights file to write")
            check_writable(out, "export output")
            return None
        refuse_overwrite(out, *protected, "export output")
        if os.path.lexists(out):   # an export is a model: never replace one (nor anything else)
            raise ConfigError(f"export output {out!r} already exists; export never replaces a file: "
                              f"move it away or name a new file")
        # last, once the folder is known not to be the checkpoint's: a file is created and removed there (as root
        # /proc passes the permission bits; export then failed with a bare "[Errno 2] ...", status 1)
        check_writable(out, "export output", probe=True)
    except ConfigError as exc:
        return str(exc)
    return None


def _describe_dir(p: Path) -> list[str]:
    """Lines about a root or run directory: where latest points, runs, committed steps, leftovers."""
    kind = "run directory" if cf.is_run_dir(p) else "checkpoint root"
    lines = [f"{kind} {str(p)!r}: latest -> {cf.read_latest(p)}"]
    lag = lagging_root(p)
    if lag is not None:   # a save that could not move the root's pointer: readers take the run's newer one
        lines[0] += f" (behind its run's own latest: {lag.newer} is read instead)"
    for d in [p] + cf.run_dirs(p):
        steps = cf.committed_steps(d)
        if d is p and not steps:
            continue
        where = "." if d is p else d.name
        lines.append(f"  {where}: {', '.join(cf.step_name(s) for s in steps) or 'no committed checkpoint'}")
        for extra in cf.leftovers(d):
            lines.append(f"  leftover from an interrupted save (ignored): {where}/{extra.name}")
    return lines


def _model_lines(source: WeightsSource) -> tuple[str, list[str]]:
    """Return ("6 layer groups, gpt vocab_size=... ", ["  tokenizer ..."]) describing the stored model."""
    kind = source.model_kind
    try:   # info describes even a damaged checkpoint: the attribute is read unhashed, a bad one reported
        stored = source.tokenizer(verify=False)
        tokenizer = None if stored is None else stored.describe()
    except ConfigError as exc:
        tokenizer = f"unreadable: {exc}"
    return (f"{count_text(kind, source.n_layers)}, {shape_text(source.model)}",
            [f"  tokenizer {tokenizer}"] if tokenizer is not None else [])


def _describe_weights_file(source: HDF5Source) -> list[str]:
    model, tokenizer = _model_lines(source)
    partial = source.partial()
    held = f"holds only {partial}, of a model of {model}" if partial else model
    lines = [f"weights file {str(source.path)!r} (not a checkpoint directory): step {source.step}, {held}",
             *tokenizer]
    label = source.describe()
    with open_checked(source.path) as f:
        for i in stored_layers(f):
            group = member(f, layer_group(i), label)
            found = members(group, label=label) if isinstance(group, h5py.Group) else {}
            shapes = ", ".join(f"{name} {tuple(getattr(found[name], 'shape', ()) or ())}" for name in sorted(found))
            lines.append(f"  layer {i}: {shapes}")
        optimizer = member(f, "optimizer", label)
        if optimizer is not None:
            attrs = dict(optimizer.attrs)
            lines.append(f"  optimizer state of {attrs.get('name')} (update count {attrs.get('steps')})")
    return lines


def info(path: str | Path) -> str:
    """Return a human summary of a checkpoint root, run, one checkpoint or a weights file."""
    p = Path(path)
    if p.is_file() and p.name != cf.LATEST:
        return "\n".join(_describe_weights_file(resolve_weights(p)))
    if hf_directory(p):
        return "\n".join(_describe_hf(p))
    if p.is_dir() and (p / ADAPTER_CONFIG).is_file() and not (p / cf.MANIFEST).exists():
        return "\n".join(describe_adapter(p))
    lines = _describe_dir(p) if p.is_dir() and not (p / cf.MANIFEST).exists() else []
    source = checkpoint_source(resolve_step_dir(p))
    m = source.manifest
    lay, opt, data = m["layout"], m["optimizer"], m.get("data", {})
    model, tokenizer = _model_lines(source)
    lines.append(f"checkpoint {str(source.path)!r}: step {source.step}, {model}")
    lines.extend(tokenizer)
    more = "".join(f" {k}={lay[k]}" for k in ("tp", "ep") if lay.get(k, 1) != 1)   # shown when used
    lines.append(f"  saved at dp={lay.get('dp')} pp={lay.get('pp')}{more} schedule={lay.get('schedule')} "
                 f"virtual_stages={lay.get('virtual_stages')}")
    lines.extend(lora_lines(m.get("config", {})))
    lines.append(f"  optimizer {opt.get('name')} (update count {opt.get('steps')}, state "
                 f"{', '.join(opt.get('state', [])) or 'none'}); data position {data.get('samples_seen')} samples")
    for e in m["files"]:
        lines.append(f"  {e['name']}: layers {e['layers']}, {e['bytes']} bytes, sha256 {e['sha256'][:16]}...")
    return "\n".join(lines)


def all_checkpoints(root: Path) -> list[Path]:
    """Return every committed checkpoint under a root or run directory (its own and its runs'), oldest run first."""
    return [d / cf.step_name(s) for d in [root] + cf.run_dirs(root) for s in cf.committed_steps(d)]


def _stop_status(signum: int) -> int:
    """75 (run it again) for SIGTERM and SIGUSR1, 130 for SIGINT, as every hpcpipe command."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcpipe.checkpoint``; returns the exit status."""
    parser = CommandParser(prog="python -m hpcpipe.checkpoint",
                                     description="Verify, export and describe hpcpipe checkpoints and weights "
                                                 "files. PATH: a checkpoint root (checkpoint.dir; its latest is "
                                                 "followed), a run-NNNN or step-NNNNNNNN directory, a latest file, "
                                                 "or a weights file.",
                                     epilog="exit status: 0 ok, 1 the checkpoint is bad (the message names the "
                                            "file) or the output could not be written (nothing is left behind), 2 "
                                            "usage error (a PATH that does not exist, a Hugging Face directory "
                                            "import cannot use, a value --dtype cannot hold), 75 stopped by "
                                            "SIGTERM/SIGUSR1 while writing (nothing written), 130 SIGINT")
    sub = parser.add_subparsers(dest="command", required=True)
    p_verify = sub.add_parser("verify", help="check manifest, sizes, SHA-256, shapes and checksums")
    p_verify.add_argument("dir", metavar="PATH", help="checkpoint root, run or step directory, latest file, "
                                                       "or weights file")
    p_verify.add_argument("--all", action="store_true", help="with a root: verify every committed checkpoint of "
                                                             "every run")
    p_export = sub.add_parser("export", help="write one weights file holding every layer (export PATH OUT), or a "
                                             "Hugging Face model directory (export PATH OUT --format hf)")
    p_export.add_argument("dir", metavar="PATH")
    p_export.add_argument("out", metavar="OUT", help="the output: a new HDF5 weights file, or with --format hf or "
                                                     "peft a new directory (never an existing one)")
    p_export.add_argument("--optimizer", action="store_true", help="also copy the optimizer state")
    p_export.add_argument("--format", choices=("hpcpipe", "hf", "peft"), default="hpcpipe",
                          help="hpcpipe: one HDF5 weights file (default); hf: a new Hugging Face model directory "
                               "(config.json, safetensors, tokenizer) for GPT and Llama-family models; peft: a LoRA "
                               "run's adapters as a new PEFT directory (adapter_config.json, "
                               "adapter_model.safetensors)")
    p_export.add_argument("--merge-adapter", action="store_true",
                          help="a LoRA run's checkpoint: write its model with the adapters merged (W + s A B)")
    p_export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                          help="with --format hf or peft: the safetensors' dtype (default float32; a weights file "
                               "is always float32)")
    p_import = sub.add_parser("import", help="write a Hugging Face model directory as one hpcpipe weights file: "
                                             "import HF_DIR OUT")
    p_import.add_argument("dir", metavar="HF_DIR", help="directory with config.json, *.safetensors, tokenizer.json")
    p_import.add_argument("out", metavar="OUT", help="output HDF5 weights file")
    p_info = sub.add_parser("info", help="print runs, step, layout, optimizer and files (or a weights file's layers)")
    p_info.add_argument("dir", metavar="PATH")
    args = parser.parse_args(argv)
    problem = one_process_problem("hpcpipe.checkpoint")
    if problem is not None:
        if launcher_rank() == 0:          # one line, not one per process
            print(f"hpcpipe: error: {problem}", file=sys.stderr)
        return 2
    if not os.path.lexists(args.dir):     # a typo, not a bad checkpoint
        print(f"hpcpipe: error: {args.dir!r} does not exist", file=sys.stderr)
        return 2
    if args.command == "export" and args.dtype and args.format == "hpcpipe":
        print(f"hpcpipe: error: --dtype {args.dtype} is for --format hf or peft: a weights file is float32",
              file=sys.stderr)
        return 2
    try:
        if args.command == "verify":
            root = Path(args.dir)
            targets = all_checkpoints(root) if args.all and root.is_dir() and not (root / cf.MANIFEST).exists() \
                and not hf_directory(root) and not (root / ADAPTER_CONFIG).is_file() else [root]
            if not targets:
                raise ConfigError(f"{str(root)!r} holds no committed checkpoint")
            for target in targets:
                source = verify(target)
                manifest = getattr(source, "manifest", None)     # a Hugging Face directory has none
                files = f"{len(manifest['files'])} files, " if manifest else ""
                held = source.partial() if hasattr(source, "partial") else ""     # one stage's file: its layers
                print(f"ok: {source.describe()} step {source.step}, {files}"
                      f"{held or count_text(source.model_kind, source.n_layers)}")
        elif args.command == "import":
            refused = export_output_error(args.out)
            if refused is None and os.path.lexists(args.out):
                refused = f"import output {args.out!r} already exists; import never replaces a file"
            if refused is None:
                refused = export_output_error(args.out, ((), ()))    # the probe: a folder that refuses files
            if refused is not None:
                print(f"hpcpipe: error: {refused.replace('export output', 'import output')}", file=sys.stderr)
                return 2
            source = import_hf(args.dir, args.out)
            print(f"imported {source.describe()} ({count_text(source.model_kind, source.n_layers)}) to {args.out!r}")
        elif args.command == "export" and args.format in ("hf", "peft"):
            try:
                check_new_directory(args.out, args.format)
                if args.merge_adapter and args.format == "peft":
                    raise ConfigError("--merge-adapter writes a merged model: --format hpcpipe or hf, not peft")
                source = resolve_weights(args.dir)
                if args.format == "hf":
                    source = exported_source(source, args.merge_adapter)
                    check_hf_exportable(source)       # the wrong kind of model is a usage error, as below
                else:
                    check_peft_exportable(source)
            except ConfigError as exc:
                print(f"hpcpipe: error: {exc}", file=sys.stderr)
                return 2
            if args.format == "peft":
                settings = export_peft(source, args.out, args.dtype or "float32")
                print(f"exported the LoRA adapters (r = {settings.rank}, {', '.join(settings.targets)}) of "
                      f"{source.describe()} step {source.step} as a PEFT directory to {args.out!r}")
                return 0
            export_hf(source, args.out, args.dtype or "float32")
            print(f"exported {source.describe()} step {source.step} as a Hugging Face model to {args.out!r}")
        elif args.command == "export":
            # a bad target is a usage error (status 2), found before the checkpoint is read; what it must not
            # replace or land in is known once the checkpoint is resolved (a bad checkpoint: status 1)
            refused = export_output_error(args.out)
            if refused is None:
                refused = export_output_error(args.out, protected_paths(args.dir, resolve_weights(args.dir)))
            if refused is None:
                refused = _merge_error(args)
            if refused is not None:
                print(f"hpcpipe: error: {refused}", file=sys.stderr)
                return 2
            source = export(args.dir, args.out, args.optimizer, args.merge_adapter)
            print(f"exported {source.describe()} step {source.step} ({count_text(source.model_kind, source.n_layers)}) "
                  f"to {args.out!r}")
        else:
            print(info(args.dir))
    except Stopped as exc:
        print(f"hpcpipe: stopped ({exc}) before the {args.command} output was whole: nothing was written; exit "
              f"status {_stop_status(exc.signum)} (run the command again)", file=sys.stderr)
        return _stop_status(exc.signum)
    except ConfigError as exc:
        print(f"hpcpipe: error: {exc}", file=sys.stderr)
        # a Hugging Face directory is input, not a checkpoint; a value --dtype cannot hold is the flag's
        # a PEFT adapter or one stage's file where a whole model belongs: UsageError
        return 2 if args.command == "import" or isinstance(exc, OutOfRange | UsageError) else 1
    except WriteFailed as exc:
        print(f"hpcpipe: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return reader_left()     # the reader (`| head`) left
    except OSError as exc:
        print(f"hpcpipe: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
