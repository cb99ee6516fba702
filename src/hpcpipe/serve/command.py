"""``python -m hpcpipe.serve``: an OpenAI-compatible HTTP endpoint in front of KV-cached pipelined generation.

    mpiexec -n 4 python -m hpcpipe.serve --weights ck --port 8000
    curl http://127.0.0.1:8000/v1/completions -d '{"prompt": "Once", "max_tokens": 20}'
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from typing import Any

from hpcpipe.cli import CommandParser, with_adapter
from hpcpipe.errors import ConfigError
from hpcpipe.hf.sampling_defaults import describe as describe_sampling
from hpcpipe.runtime.backend import runs_on_gpu
from hpcpipe.runtime.job import run_job
from hpcpipe.runtime.signals import StopSignals
from hpcpipe.serve.setup import ServeSetup, kept_format, prepare, widens_format

API_KEY_ENV = "HPCPIPE_API_KEY"

DESCRIPTION = """Serve a GPT, Llama-family (llama, mistral, qwen2, qwen3) or mixture-of-experts (mixtral, qwen3_moe)
model over HTTP (the OpenAI completions and chat APIs) with pipeline (pp) x data (dp) x tensor (tp) parallelism
over MPI, experts spread over parallel.ep replicas. World rank 0 runs the HTTP front end; every dp replica is
one pipeline decoding its running sequences with continuous batching and a KV cache per stage, each stage
split over parallel.tp ranks by heads (its KV cache too). The model and tokenizer are the ones
stored with the weights; the layout comes from [parallel] (without parallel.pp: pp = world size / (dp x tp)
when parallel.dp is given, else one stage per rank, as many as the layer groups allow, dp the rest and divisible
by parallel.ep), the limits from [serve]."""

EPILOG = """endpoints: POST /v1/completions (logprobs, echo) and POST /v1/chat/completions, both streaming too,
  GET /v1/models (and /v1/models/NAME), GET /health, GET /metrics (Prometheus)

examples:
  mpiexec -n 4 python -m hpcpipe.serve --weights gpt-text-ck --port 8000
  mpiexec -n 8 python -m hpcpipe.serve --weights model.h5 --set parallel.pp=4 --set serve.max_sequences=64
  mpiexec -n 2 python -m hpcpipe.serve --weights SmolLM2-135M --set parallel.pp=1 --set parallel.tp=2

With HPCPIPE_API_KEY set in the environment, every /v1/ request must send "Authorization: Bearer <key>"
(the openai client's api_key) or is answered 401; /health and /metrics stay open.
SIGTERM (or SIGUSR1) stops accepting requests (503), finishes those in flight and exits 0.
A --host other than loopback without HPCPIPE_API_KEY is served, with a warning; an empty HPCPIPE_API_KEY
is refused. With work pending and no decode step for run.stall_timeout seconds (a stopped or hung rank),
every thread's stack is dumped and the job aborted (exit 76); /health answers 503 after a quarter of that.
exit status: 0 stopped by a signal after draining, 1 a rank failed, 2 bad configuration or input,
  76 the watchdog saw no progress for run.stall_timeout seconds (stacks dumped, job aborted),
  130 interrupted (SIGINT, Ctrl-C: every rank stops at once, requests in flight are cut off)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = CommandParser(prog="python -m hpcpipe.serve", description=DESCRIPTION, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, metavar="PATH",
                        help="weights file, checkpoint directory, step-NNNNNNNN directory, latest file, or a "
                             "Hugging Face model directory")
    parser.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter directory (adapter_config.json, "
                        "adapter_model.safetensors) served on the --weights base, merged (same as --set model.adapter)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    parser.add_argument("--config", metavar="FILE", help="TOML config file ([parallel], [serve], [run] apply)")
    parser.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                        help="override one config key (TOML value syntax); repeatable")
    args = with_adapter(parser.parse_args(argv))
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    args.api_key = os.environ.get(API_KEY_ENV, "")
    if API_KEY_ENV in os.environ and not args.api_key:    # "set" must never quietly mean "no key at all"
        parser.error(f"{API_KEY_ENV} is set but empty: export a key (e.g. $(openssl rand -hex 16)) or unset "
                     f"{API_KEY_ENV} to serve without one")
    if args.api_key and not all(33 <= ord(c) <= 126 for c in args.api_key):
        # an HTTP header cannot carry it intact: no client could ever send it
        parser.error(f"{API_KEY_ENV} must be printable ASCII without spaces ({len(args.api_key)} characters given)")
    return args


def layout_words(p: ServeSetup) -> str:
    """The serving line's description of a set-up job: its layout, weight format, adapter and the model's sampling
    defaults."""
    cfg = p.config
    words = f"dp={p.dp} x pp={p.pp}" + (f" x tp={p.tp}" if p.tp > 1 else "")
    words += f", experts over ep={cfg.parallel.ep}" if cfg.parallel.ep > 1 else ""
    # after select_backend in this process: "auto" became CuPy where a GPU is seen, and its stages keep float32
    gpu = runs_on_gpu(cfg.run.backend)
    fmt = kept_format(cfg, p.model, on_gpu=gpu)
    if widens_format(cfg, p.model, on_gpu=gpu):    # "q8_0" alone read as a quarter of the bytes: they are float32
        values = "the stored values" if fmt != "q8_0" else \
            "q8_0-rounded values, the experts' as stored" if _has_experts(p.model) else "q8_0-rounded values"
        fmt = f"{cfg.model.dtype} ({values}; this layout's NumPy steps widen every matrix)"
    elif fmt == "stored":        # "stored" alone would not say whether a float32 file's 4 bytes are kept
        fmt = f"as stored ({'16-bit' if p.weights.matrix_itemsize() == 2 else 'float32'})"
    elif fmt == "float32" and cfg.model.dtype == "float64":     # "float32" widens to the stages' dtype
        fmt = "float64"
    words += f", weights {fmt}"
    words += f", adapter {cfg.model.adapter}" if cfg.model.adapter else ""
    sampling = describe_sampling(p.sampling_defaults)    # what a request that leaves them out samples with
    return words + (f", sampling defaults {sampling} (generation_config.json)" if sampling else "")


def _has_experts(model: Any) -> bool:
    """Whether any layer group holds experts (a q8_0 read leaves them as stored: hpcpipe.hf.names)."""
    return any(model.expert_shards(i, 1, 0) for i in range(len(model.specs)))


def reachable_from_outside(host: str) -> bool:
    """Whether listening on host may accept connections from other machines (any address that is not loopback)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return True          # the bind fails later and says why; no reason to keep quiet here
    return any(not ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


class Frontend:
    """The HTTP side on world rank 0: broker, metrics and the aiohttp server thread."""

    def __init__(self, p: ServeSetup, host: str, port: int, api_key: str = ""):
        self.setup, self.host, self.port, self.api_key = p, host, port, api_key
        self.server = self.prompts = self.broker = None

    def open(self):
        """Start the prompt workers (the chat template proven to render), bind the port and start the HTTP
        thread; return the broker (the engine's source). /health answers 503 "starting" until ready()."""
        from hpcpipe.serve.broker import Broker
        from hpcpipe.serve.http_api import HttpServer, make_app
        from hpcpipe.serve.metrics import Metrics
        from hpcpipe.serve.openai_schema import check_limits
        from hpcpipe.serve.prompt_pool import PromptPool, check_chat_template
        srv, tokenizer, limits = self.setup.config.serve, self.setup.tokenizer, check_limits(None)
        self.prompts = PromptPool(tokenizer, limits["prompt_workers"], limits["prompt_seconds"],
                                  limits["max_chat_chars"])
        try:     # a template that cannot render is the model's fault: refused now, not blamed on every client
            self.prompts.start()
            check_chat_template(self.prompts)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"--weights {str(self.setup.weights.path)!r}: {exc}") from None
        self.broker = Broker(self.setup.dp * srv.max_sequences + srv.max_queue, ready=False)
        app = make_app(self.broker, Metrics(), tokenizer, self.setup.model_name, self.setup.shape.seq_len,
                       api_key=self.api_key, stall_timeout=self.setup.config.run.stall_timeout, prompts=self.prompts,
                       sampling=self.setup.sampling_defaults)
        self.server = HttpServer(app, self.host, self.port)
        try:
            self.host, self.port = self.server.start()
        except OSError as exc:
            raise ConfigError(str(exc.strerror or exc).removeprefix("hpcpipe: error: ")) from None
        return self.broker

    def ready(self) -> None:
        """Say where the server listens (every rank has loaded its stage)."""
        p = self.setup
        guard = f"API key required ({API_KEY_ENV})" if self.api_key else f"no API key ({API_KEY_ENV} unset)"
        if not self.api_key and reachable_from_outside(self.host):
            print(f"hpcpipe: warning: serving on {authority(self.host, self.port)}, which other machines can reach, "
                  f"without an API key: anyone who reaches this node can use the server; set {API_KEY_ENV} "
                  f"(docs/serve.md)", file=sys.stderr, flush=True)
        print(f"hpcpipe: serving {p.model_name!r} on {base_url(self.host, self.port)} ({layout_words(p)}, "
              f"{p.config.serve.max_sequences} sequences per replica; {guard})", flush=True)
        self.broker.set_ready()      # after the serving line: a probe that sees ok finds the line printed

    def close(self) -> None:
        """Stop the HTTP thread (after the engine drained), then the prompt workers."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.prompts is not None:
            self.prompts.close()
            self.prompts = None


def main(argv: list[str] | None = None, stop: StopSignals | None = None) -> int:
    """Entry point of ``python -m hpcpipe.serve`` (``stop``: its early handlers); returns the exit status."""
    stop = stop or StopSignals().install()
    args = parse_args(argv)
    from mpi4py import MPI

    from hpcpipe.serve.engine import run
    world = MPI.COMM_WORLD

    def body(p: ServeSetup) -> int:
        frontend = Frontend(p, args.host, args.port, args.api_key)
        try:
            counts = run(p, world, frontend.open, stop, frontend.ready, frontend.close)
        finally:
            frontend.close()
        if world.Get_rank() == 0:
            print(f"hpcpipe: stopped ({counts['reason']}): {counts['tokens']} tokens generated in "
                  f"{counts['seconds']:.1f} s", flush=True)
        return 0

    try:
        return run_job(world, lambda: prepare(args.weights, world.Get_size(), args.config, args.overrides), body,
                           lambda: f"rank {world.Get_rank()}")
    finally:
        stop.ignore()   # as train: a second signal while the ranks shut down must not kill one


def authority(host: str, port: int) -> str:
    """host:port as a URL writes it: an IPv6 address in brackets ([::1]:8000; 'http://::1:8000' is no URL)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def base_url(host: str, port: int) -> str:
    """The server's OpenAI base URL, http://HOST:PORT/v1 (what the openai client's base_url takes)."""
    return f"http://{authority(host, port)}/v1"
