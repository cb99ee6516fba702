"""``python -m hpcpipe.plan``: profile the model, then choose layout, schedule and stage cut under a memory budget.

    python -m hpcpipe.plan --config C --ranks N [--memory-per-rank 8GiB] [--top 5] [--write best.toml]
                           [--nodes K --network PROBE.json]

Measures each layer group here (cached: a second plan of the same model is
instant), predicts every plan for the configured global batch on N ranks with
the simulator, discards those whose peak memory per rank exceeds the budget,
prints the best as a table with the reason the first wins, and writes it as a
config that ``mpiexec -n N python -m hpcpipe.train --config best.toml`` runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
import time

from hpcpipe.cli import CommandParser, add_print_config, print_config, reader_left
from hpcpipe.config import DECODERS, Config
from hpcpipe.config_toml import to_toml
from hpcpipe.errors import EXIT_CONFIG, ConfigError
from hpcpipe.plan import memory_floor, report
from hpcpipe.plan.profiling import largest_profiled_rows, load_profile, profile_sizes
from hpcpipe.plan.search import layouts, micro_batch_rows, search
from hpcpipe.profiles.comm_model import CommModel, Placement
from hpcpipe.profiles.profile import default_cache_dir
from hpcpipe.runtime.host_memory import available_bytes, rank_share
from hpcpipe.state.outputs import check_writable, file_kind, write_new
from hpcpipe.state.sources import refuse_overwrite
from hpcpipe.train.setup import check_training_format, load_run_config

UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": 1024 ** 2, "mib": 1024 ** 2, "g": 1024 ** 3,
         "gib": 1024 ** 3, "t": 1024 ** 4, "tib": 1024 ** 4, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3,
         "tb": 1000 ** 4}


def parse_bytes(text: str) -> int:
    """Parse a memory size: 8GiB, 8G (binary, as Slurm's --mem), 512MiB, 8GB (decimal), or plain bytes."""
    match = re.fullmatch(r"\s*([-+]?)\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(3).lower() if match else None
    if match is None or unit not in UNITS:
        raise ConfigError(f"--memory-per-rank {text!r} is not a size: give a number with a unit such as "
                          f"8GiB, 8G, 512MiB or 8GB")
    if match.group(1) == "-" and float(match.group(2)) > 0:
        raise ConfigError(f"--memory-per-rank {text!r} is a negative budget: give the memory one rank may use, "
                          f"e.g. 8GiB")
    value = int(float(match.group(2)) * UNITS[unit])
    if value <= 0:
        raise ConfigError(f"--memory-per-rank {text!r} must be more than 0 bytes")
    return value


def host_cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def configured_global_batch(config: Config, ranks: int) -> int:
    """The config's global batch: dp x micro_batches x micro_batch_size, dp as the config resolves on N ranks."""
    par, tr = config.parallel, config.train
    if isinstance(par.dp, int):
        dp = par.dp
    elif isinstance(par.pp, int) and ranks % (par.pp * par.tp) == 0:
        dp = ranks // (par.pp * par.tp)
    else:
        dp = 1
    return dp * tr.micro_batches * tr.micro_batch_size


MAX_RANKS = 1 << 20      # a million ranks: beyond any machine, and still planned in seconds


def _parser() -> CommandParser:
    p = CommandParser(prog="python -m hpcpipe.plan", description=__doc__.split("\n\n")[0].replace("``", ""),
                      formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML config (default: the embedded default job)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--ranks", type=int, help="MPI ranks of the job to plan (required)")
    p.add_argument("--memory-per-rank", metavar="SIZE", dash_value=True,
                   help="budget per rank, e.g. 8GiB (default: this node's available memory over its ranks, "
                        "or less under ulimit -v)")
    p.add_argument("--top", type=int, default=5, help="plans to print (default 5)")
    p.add_argument("--write", metavar="TOML", help="write the best plan as a config file (must not exist)")
    p.add_argument("--json", metavar="PATH", help="write every feasible plan as JSON (must not exist)")
    p.add_argument("--global-batch", type=int, help="samples per step (default: the config's dp x "
                   "train.micro_batches x train.micro_batch_size)")
    p.add_argument("--cores", type=int, help="cores the ranks share on one node (default: one core per rank)")
    p.add_argument("--max-micro-batches", type=int, default=64, help="largest micro-batch count tried (default 64)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the ranks run on, ranks / nodes consecutive ranks "
                   "a node (default 1)")
    p.add_argument("--network", metavar="PROBE.json", help="the link between nodes: the probe run on 2 ranks of "
                   "2 nodes (mpiexec -ppn 1 -n 2 python -m hpcpipe.plan.probe --out PROBE.json); needed with --nodes")
    p.add_argument("--host-shared", action="store_true", help="the --nodes are emulated on this one host (network "
                   "namespaces: jobs/netns-cluster.sh): every rank shares its cores and memory, so the profile "
                   "measures them side by side as on one node")
    p.add_argument("--profile-dir", help=f"profile cache (default $HPCPIPE_PROFILE_DIR or {default_cache_dir()})")
    p.add_argument("--refresh-profile", action="store_true", help="measure again even when a profile is cached")
    add_print_config(p)
    return p


def _check_args(args) -> None:
    for name in ("ranks", "top", "cores", "max_micro_batches", "global_batch", "nodes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.ranks > MAX_RANKS:
        raise ConfigError(f"--ranks {args.ranks} is more than the planner searches ({MAX_RANKS})")
    if args.ranks % args.nodes:
        raise ConfigError(f"--ranks {args.ranks} is not a multiple of --nodes {args.nodes}: give each node as many "
                          f"ranks")
    if args.nodes > 1 and not args.network:
        raise ConfigError(f"--nodes {args.nodes} needs --network PROBE.json, the link between two nodes measured "
                          f"once: mpiexec -ppn 1 -n 2 (one rank on each of 2 nodes) python -m hpcpipe.plan.probe "
                          f"--out PROBE.json")
    if args.host_shared and args.nodes == 1:
        raise ConfigError("--host-shared says the --nodes are emulated on this host: give --nodes (more than 1) "
                          "and --network with it")
    if args.network is not None and args.nodes == 1:
        raise ConfigError("--network is the link between nodes: give --nodes (more than 1) with it")
    if args.cores is not None and args.cores > host_cores():
        # the profile is measured on this machine's cores; a bigger node is planned with --ranks alone
        raise ConfigError(f"--cores {args.cores} is more than this machine's {host_cores()} cores, which the "
                          f"profile is measured on; plan more ranks than cores here with --ranks alone (one core "
                          f"per rank, printed as a prediction)")
    for name in ("write", "json"):
        if getattr(args, name) == "":
            raise ConfigError(f"--{name} needs a file name (it was empty)")
    if args.write and args.json and os.path.abspath(args.write) == os.path.abspath(args.json):
        raise ConfigError(f"--write and --json name the same file {args.write!r}: give each its own")
    for name in ("write", "json"):
        path = getattr(args, name)
        if path and os.path.lexists(path):     # a dangling symlink too: writing would follow it
            raise ConfigError(f"--{name} {path!r} exists; the planner does not overwrite files: remove it or "
                              f"give a new path")
        if path:
            # a missing directory, a file where one should be, or a place nothing can be created (/proc)
            check_writable(path, f"--{name}", probe=True)
            refuse_overwrite(path, (), (), f"--{name}")   # never into a checkpoint: pruning would delete it
    cache = args.profile_dir or default_cache_dir()
    if os.path.exists(cache) and not os.path.isdir(cache):   # found now, not after the MPI probe
        how = "--profile-dir" if args.profile_dir else "the profile cache ($HPCPIPE_PROFILE_DIR or ~/.cache)"
        raise ConfigError(f"{how} {cache!r} is not a directory")


def make_cache(args) -> None:
    """Create the profile cache folder before measuring (ConfigError when impossible): --profile-dir /proc/x
    failed only after the MPI probe's measurements. An existing read-only cache may still hold the profile."""
    cache = args.profile_dir or default_cache_dir()
    if os.path.exists(cache):
        return
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError as exc:
        how = "--profile-dir" if args.profile_dir else "the profile cache ($HPCPIPE_PROFILE_DIR or ~/.cache)"
        raise ConfigError(f"{how} {cache!r} cannot be created: {exc.strerror or exc} (set HPCPIPE_PROFILE_DIR "
                          f"or --profile-dir to a writable directory)") from None


def engine_text(engine: dict) -> str:
    """One line on the profile's calibration against real training runs."""
    if "replicas" not in engine:
        return f"not calibrated ({engine.get('failed', 'no calibration run')}); times are the layer bench's"
    parts = []
    for name, label in (("replicas", "replicas"), ("pipeline", "pipeline 1F1B"), ("pipeline_zb", "ZB-H1"),
                        ("tensor", f"tp={engine.get('tensor', {}).get('tp')}")):
        run = engine.get(name)
        if run:
            mean = sum(run["forward"] + run["backward"]) / len(run["forward"] + run["backward"])
            parts.append(f"{label} {mean:.2f}x")
    tensor = engine.get("tensor") or {}
    each = f"; a tp collective took {tensor['collective_s'] / tensor['collectives'] * 1e3:.2f} ms in a step" \
        if tensor.get("collectives") else ""
    return (f"real runs take {', '.join(parts)} the layer bench's times; replicas wait "
            f"{engine['replicas']['sync_share']:.1%} of a step at the allreduce{each}")


def plan_threads(ranks: int, cores: int | None, here: int) -> int:
    """BLAS threads a rank of the planned job computes with (what hpcpipe gives each rank of a node)."""
    explicit = os.environ.get("HPCPIPE_THREADS", "")
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    local = ranks if cores is not None else min(ranks, here)
    return max(1, (cores or here) // local)


def network_model(path: str) -> CommModel:
    """The link between nodes, fitted to a probe result file (ConfigError naming the file when it is not one)."""
    if os.path.exists(path) and not os.path.isfile(path):    # opening a named pipe would wait for good
        raise ConfigError(f"--network {path!r} is {file_kind(path)}, not a probe result file; write one with "
                          f"python -m hpcpipe.plan.probe --out")
    try:
        with open(path) as f:
            probe = json.load(f)
    except OSError as exc:
        raise ConfigError(f"--network {path!r}: cannot read it: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"--network {path!r} is not JSON ({exc}); write it with python -m hpcpipe.plan.probe "
                          f"--out") from None
    try:
        return CommModel.from_probe(probe)
    except ConfigError as exc:
        raise ConfigError(f"--network {path!r}: {exc}") from None


def run(args) -> int:
    """Plan and report; returns the exit status."""
    start = time.perf_counter()
    if args.print_config:
        return print_config(load_run_config(args.config, args.set).to_dict(), "python -m hpcpipe.plan")
    _check_args(args)
    budget = parse_bytes(args.memory_per_rank) if args.memory_per_rank is not None else None
    network = network_model(args.network) if args.network else None
    # as train reads it: a Hugging Face model.init restates the model's kind and shape from its config.json
    config = load_run_config(args.config, args.set)
    check_training_format(config)      # the written config would be refused by the train command it prints
    here = host_cores()
    global_batch = args.global_batch or configured_global_batch(config, args.ranks)
    per_node = args.ranks // args.nodes     # a node like this one holds these ranks: its memory and cores are theirs
    # emulated nodes share this host: their ranks compute side by side here, as the ranks of one node would
    per_host = args.ranks if args.host_shared else per_node
    local_ranks = per_host if args.cores is not None else min(per_host, here)
    if budget is not None:
        budget_how = "--memory-per-rank"
    else:
        # the node's memory is shared by its ranks, an address-space limit (ulimit -v) holds for each one
        budget, budget_how = rank_share(local_ranks)
    # before anything is allocated: a model no plan can hold is refused from arithmetic alone
    memory_floor.check_budget(config, args.ranks, global_batch, budget, budget_how)
    rows = micro_batch_rows(config, global_batch, args.ranks, args.max_micro_batches)
    threads = plan_threads(per_host, args.cores, here)
    # ranks computing at once on one node like this one: they share its memory bandwidth while profiled too
    concurrent = max(1, min(per_host if args.cores is None else args.cores, here) // threads)
    sizes = profile_sizes(rows, largest=largest_profiled_rows(config))

    def before_measuring() -> None:
        memory_floor.check_profiling(config, sizes, concurrent, available_bytes())
        make_cache(args)
    profile = load_profile(config, sizes, threads, args.profile_dir or default_cache_dir(),
                           args.refresh_profile, concurrent, before_measuring=before_measuring,
                           tps=tuple(sorted({tp for _, _, tp in layouts(config, args.ranks, global_batch)} - {1})))
    placement = Placement(profile.comm, network, per_node if network is not None else None)
    result = search(config, profile, args.ranks, global_batch, budget, args.cores, args.max_micro_batches, placement)
    gpt = config.model.kind in DECODERS
    if not result.feasible:
        least = min(result.predictions, key=lambda p: p.peak_bytes)
        raise ConfigError(f"no plan for {args.ranks} ranks fits {report.size_text(budget)} per rank "
                          f"({budget_how}); the smallest feasible budget is {report.size_text(least.peak_bytes)} "
                          f"({least.peak_bytes} bytes, {report.describe(least)})")
    print(f"hpcpipe.plan: {config.layers_text()}, {config.model.dtype}, global batch {global_batch} on "
          f"{args.ranks} ranks, budget {report.size_text(budget)} per rank ({budget_how})")
    print(f"profile: {'cached' if profile.from_cache else 'measured'} ({profile.layers['backend']}, {threads} BLAS "
          f"thread(s) per rank, {concurrent} rank(s) side by side, micro-batch sizes {profile.sizes}); comm: "
          f"{link_text(profile.comm)}" + (f" within a node; between nodes ({args.nodes} x {per_node} ranks, --network "
                                          f"{args.network}): {link_text(network)}" if network is not None else ""))
    print(f"engine: {engine_text(profile.data.get('engine') or {})}")
    if args.cores is not None:
        print(f"cores: {args.cores} shared by the {args.ranks} ranks (simulated as shared)")
    elif args.ranks > here:
        print(f"PREDICTION: {args.ranks} ranks are more than this machine's {here} cores; the times assume one core "
              f"per rank, each as fast as this machine's, and messages as fast as between two ranks here "
              + ("(between nodes: as --network measured)" if network is not None else
                 "(a network between nodes is slower)") + ": run the plan to check it")
    print(f"{result.tried} plans predicted, {len(result.feasible)} within the budget\n")
    best = result.feasible[:args.top]
    print(report.table(best, gpt))
    print()
    print(report.reason(best[0], result.feasible, len(result.predictions) - len(result.feasible)))
    if args.write:
        p = best[0]
        header = (f"written by {planner_command(args.argv)}\n{report.describe(p)}\n"
                  f"predicted step {p.step_time_s:.4f} s, peak {report.size_text(p.peak_bytes)} per rank\n"
                  f"run: mpiexec -n {args.ranks} python -m hpcpipe.train --config {args.write}")
        write_new(args.write, "--write", to_toml(report.planned_config(config, p), header))
        print(f"\nwrote {args.write}: mpiexec -n {args.ranks} python -m hpcpipe.train --config {args.write}")
    if args.json:
        doc = {"ranks": args.ranks, "global_batch": global_batch, "budget_bytes": budget,
               "prediction_only": args.cores is None and args.ranks > here, "cores": args.cores,
               "threads": threads, "profile_cached": profile.from_cache, "nodes": args.nodes,
               "network": args.network,
               "plans": [report.plan_dict(p) for p in result.feasible]}
        write_new(args.json, "--json", json.dumps(doc, indent=1))
    print(f"\nplanned in {time.perf_counter() - start:.1f} s")
    return 0


def link_text(model: CommModel) -> str:
    """A link model as 'latency + bandwidth', e.g. '4.6 us + 9.25 GB/s'."""
    return f"{model.latency_s * 1e6:.1f} us + {1 / max(model.seconds_per_byte, 1e-30) / 1e9:.2f} GB/s"


def planner_command(argv: list[str]) -> str:
    """The command line that made a plan, as one printable line (the written config's header says how to re-plan)."""
    text = shlex.join(["python", "-m", "hpcpipe.plan", *argv])
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcpipe.plan``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.ranks is None and not args.print_config:
        parser.error("the following arguments are required: --ranks")
    args.argv = argv
    # SIGTERM unwinds like Ctrl-C, so that profiling and calibration children are killed and their
    # temporary directories removed (the default action ended the planner alone and orphaned them)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return run(args)
    except ConfigError as exc:
        print(f"hpcpipe: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except BrokenPipeError:
        return reader_left()     # the reader (`| head`) left
    except KeyboardInterrupt:
        print("hpcpipe.plan: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 130
    except _Terminated:
        print("hpcpipe.plan: terminated (SIGTERM)", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Terminated(BaseException):
    """SIGTERM arrived: unwind every finally block (children killed, temporary files removed), then exit 143."""


def _terminated(signum, frame) -> None:
    raise _Terminated()


if __name__ == "__main__":
    sys.exit(main())
