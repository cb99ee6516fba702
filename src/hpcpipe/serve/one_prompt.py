"""One prompt through the KV-cached pipeline, the completion streamed to stdout: ``python -m hpcpipe.generate``.

:mod:`hpcpipe.generate` is the command's entry point (stop handlers first); this is what it runs.

    mpiexec -n 4 python -m hpcpipe.generate --weights ck --prompt "Once upon a time" --max-new-tokens 40
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time

from hpcpipe.cli import CommandParser, with_adapter
from hpcpipe.errors import EXIT_PREEMPTED, ConfigError, HpcpipeError
from hpcpipe.infer.rows import check_output
from hpcpipe.runtime.job import run_job
from hpcpipe.runtime.signals import StopSignals
from hpcpipe.serve.broker import Event, Request
from hpcpipe.serve.sampling import SamplingParams
from hpcpipe.serve.setup import ServeSetup, prepare
from hpcpipe.serve.textstream import TextStream
from hpcpipe.state.outputs import write_json_output
from hpcpipe.state.sources import protected_paths

DESCRIPTION = """Generate text from a GPT or Llama-family model (hpcpipe weights, a checkpoint, or a Hugging Face
model directory) with pipeline (pp) x data (dp) x tensor (tp) parallelism over MPI: the prompt is
prefilled through the pipeline, then each new token is decoded with a KV cache per stage (split over
parallel.tp ranks by heads). The model and tokenizer are the ones stored with the weights; the layout comes
from [parallel]: without parallel.pp (other parallel keys may be given), pp = world size / (dp x tp) when
parallel.dp is given, else one stage per rank, as many as the layer groups allow, dp the rest (divisible by
parallel.ep); parallel.virtual_stages must be 1."""

EPILOG = """examples:
  mpiexec -n 4 python -m hpcpipe.generate --weights gpt-text-ck --prompt "Q: What is" --max-new-tokens 60
  mpiexec -n 2 python -m hpcpipe.generate --weights model.h5 --prompt "abc" --temperature 0 --set parallel.pp=2
  mpiexec -n 2 python -m hpcpipe.generate --weights SmolLM2-135M-Instruct --chat --prompt "What is MPI?" \\
      --set parallel.pp=2 --set model.seq_len=2048
  mpiexec -n 2 python -m hpcpipe.generate --weights model.h5 --prompt "abc" --set parallel.pp=1 --set parallel.tp=2

The completion is printed to stdout as it is generated (the prompt is not repeated), and nothing else is:
the MPI line and the summary go to stderr. --json FILE also writes {"writer", "prompt", "completion",
"prompt_tokens", "tokens", "finish_reason", "seconds", "ep_comm_s"} (writer: "hpcpipe.generate", so a later
--json may replace the file; ep_comm_s: the slowest rank's seconds in the experts' all-to-alls over the whole
run, 0 without expert parallelism). A temperature below 1e-4 is greedy, as 0.

exit status: 0 success, 1 a rank failed while running, 2 bad configuration or input, 75 stopped by
  SIGTERM/SIGUSR1 before the completion was whole (nothing written; run it again), 76 the watchdog saw
  no progress for run.stall_timeout seconds (stacks dumped, job aborted), 130 interrupted (SIGINT)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = CommandParser(prog="python -m hpcpipe.generate", description=DESCRIPTION, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, metavar="PATH",
                        help="weights file, checkpoint directory, step-NNNNNNNN directory, latest file, or a "
                             "Hugging Face model directory")
    parser.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter directory (adapter_config.json, "
                        "adapter_model.safetensors) served on the --weights base, merged (same as --set model.adapter)")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue (with --chat: the user's "
                                                                       "message)")
    parser.add_argument("--chat", action="store_true",
                        help="send --prompt as one user message through the model's chat template (as "
                             "POST /v1/chat/completions does) and answer as the assistant")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="tokens to generate at most; generation also stops when the context is full (64)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 = greedy, as is anything below 1e-4 (default: the model's generation_config.json, "
                             "else 1.0)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="sample among the K likeliest (0 = off; default: the model's, else off)")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help="nucleus sampling mass (1 = off; default: the model's, else off)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0: the same text every run)")
    parser.add_argument("--config", metavar="FILE", help="TOML config file ([parallel], [serve], [run] apply)")
    parser.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                        help="override one config key (TOML value syntax); repeatable")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    return with_adapter(parser.parse_args(argv))


# what an option left out samples with when the model's generation_config.json does not say
UNSET_SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


def check_request(args: argparse.Namespace, p: ServeSetup, tokenize: bool = True) -> Request | None:
    """Return the request the arguments describe; ConfigError names a bad value. With ``tokenize`` False only the
    options are checked and None is returned (every rank's setup does that; world rank 0 alone, which holds the
    source, prepares the prompt then: once, not in a prompt worker per rank)."""
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    defaults = {**UNSET_SAMPLING, **p.sampling_defaults}     # the model's generation_config.json, else OpenAI's
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    if not args.prompt:
        raise ConfigError("--prompt is empty: give at least one character to continue")
    if args.json is not None:   # refused now, not after generating: never into the weights or a checkpoint
        files, dirs = protected_paths(args.weights, p.weights)
        check_output(args.json, args.weights, files, dirs, "--json path", "generate")
    if not tokenize:
        return None
    ids = prompt_ids(args.prompt, args.chat, p.tokenizer)
    if len(ids) >= p.shape.seq_len:     # as serve: prompt + new tokens fit the context (it said "128 + 1 = 128")
        fills = "" if len(ids) > p.shape.seq_len else \
            f", which it fills: no token can follow it (at most {p.shape.seq_len - 1} prompt tokens)"
        raise ConfigError(f"--prompt is {len(ids)} tokens long but the model's context is model.seq_len = "
                          f"{p.shape.seq_len} tokens{fills}")
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    return Request("generate-0", [int(i) for i in ids], args.max_new_tokens, params, time.monotonic())


def prompt_ids(prompt: str, chat: bool, tokenizer) -> list[int]:
    """Return the token ids of --prompt (with --chat: one user message through the model's chat template) as the
    server makes them: in a prompt worker, under its time and size budgets, a Rust panic of the tokenizer kept
    out of the terminal; ConfigError of one line when impossible."""
    from hpcpipe.serve.api_error import ApiError
    from hpcpipe.serve.openai_schema import check_limits
    from hpcpipe.serve.prompt_jobs import unicode_problem
    from hpcpipe.serve.prompt_pool import PromptPool
    problem = unicode_problem(prompt)
    if problem is not None:     # the command line's bytes that are not UTF-8 arrive as U+DC80..U+DCFF
        at, code = problem
        what = f"byte 0x{code - 0xDC00:02X}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise ConfigError(f"--prompt is not valid UTF-8 text: {what} at position {at} (check the terminal's or "
                          f"the file's encoding)")
    if chat:          # the server's 400 advises /v1/completions; here, leaving out --chat
        no_template = no_chat_template(tokenizer)
        if no_template:
            raise ConfigError(f"--chat: {no_template}; leave out --chat to continue --prompt as plain text")
    job = {"chat": [{"role": "user", "content": prompt}]} if chat else {"text": prompt, "where": "--prompt"}
    limits = check_limits(None)
    try:
        with PromptPool(tokenizer, 1, limits["prompt_seconds"], limits["max_chat_chars"]) as pool:
            return pool.run([job])[0]
    except ApiError as exc:
        raise ConfigError(f"--chat: {exc.message}" if chat else exc.message) from None


def no_chat_template(tokenizer) -> str:
    """Why ``tokenizer``'s model cannot render a chat ('' when it has a chat template): a bytes or chars tokenizer,
    or a Hugging Face one without a template (or with several, none named default)."""
    from hpcpipe.hf.chat import ChatError, NoChatTemplate, chat_template
    files = getattr(tokenizer, "files", None)
    if files is None:
        return f"this model has a {tokenizer.kind} tokenizer and no chat template"
    try:
        if chat_template(files) is None:
            return ("this model has no chat template (no chat_template in tokenizer_config.json and no "
                    "chat_template.jinja)")
    except NoChatTemplate as exc:
        return str(exc)
    except ChatError:
        return ""          # a broken template: rendering it says what is wrong
    return ""


def _tokens(n: int) -> str:
    """'1 token', 'n tokens'."""
    return f"{n} token" if n == 1 else f"{n} tokens"


def full_context_note(source: OneShot, request: Request, p: ServeSetup) -> str:
    """Why fewer tokens came than --max-new-tokens asked for, when the context filled up ('' otherwise)."""
    if source.finish != "length" or len(source.tokens) >= request.max_new:
        return ""
    return (f" (the context is full: {len(request.prompt)} prompt + {len(source.tokens)} new "
            f"{_tokens(len(source.tokens)).split()[1]} = "
            f"model.seq_len {p.shape.seq_len}, short of --max-new-tokens {request.max_new})")


def write_json(path: str, doc: dict) -> None:
    """Write doc to path whole or not at all (a temporary file beside it, then rename)."""
    try:
        write_json_output(path, doc, "generate", "--json path")
    except OSError as exc:
        raise HpcpipeError(f"cannot write --json {path!r}: {exc.strerror or exc}") from None


class OneShot:
    """The engine's source for one prompt: hands it over once, prints the text as the tokens arrive."""

    def __init__(self, request: Request, text: TextStream, out=sys.stdout):
        self.request, self.text, self.out = request, text, out
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.outstanding = 1
        self.closed = False
        self._given = False
        self._cancel = False

    def take(self) -> tuple[list[Request], list[str]]:
        """Return the prompt's request the first time; after a stop signal, its cancellation once."""
        if self._cancel:
            self._cancel = False
            return [], [self.request.id]
        if self._given:
            return [], []
        self._given = True
        return [self.request], []

    def deliver(self, events: list[Event]) -> None:
        """Print the new text; remember the finish."""
        for event in events:
            self.tokens.extend(event.tokens)
            self.out.write(self.text.feed(event.tokens))
            if event.finish is not None:
                self.finish = event.finish
                self.out.write(("" if event.finish == "cancelled" else self.text.finish()) + "\n")
                self.outstanding, self.closed = 0, True
        self.out.flush()

    def set_running(self, n: int) -> None:
        """Nothing to show."""

    def set_engine_stats(self, stats: tuple[int, ...]) -> None:
        """Nothing to show."""

    def progressed(self, at: float) -> None:
        """Nothing to show (no /health here)."""

    def close(self, reason: str) -> None:
        """A stop signal: cancel the prompt, so that generation stops after the step in flight (exit 75)."""
        if self.finish is not None:
            return                      # whole already: the run ends as if no signal had come
        self.closed = True
        if self._given:
            self._cancel = True
        else:
            self._given, self.outstanding, self.finish = True, 0, "cancelled"


def stopped_line(reason: str, source: OneShot, request: Request) -> str:
    """rank 0's line when a stop signal cancelled the prompt before its completion was whole."""
    return (f"hpcpipe: stopped ({reason}) after {len(source.tokens)} of up to {request.max_new} new tokens: the "
            f"completion is not whole, nothing written; exit status {EXIT_PREEMPTED} (run the command again)")


def main(argv: list[str] | None = None, stop: StopSignals | None = None) -> int:
    """Entry point of ``python -m hpcpipe.generate`` (``stop``: its early handlers); returns the exit status."""
    stop = stop or StopSignals().install()
    args = parse_args(argv)
    from mpi4py import MPI

    from hpcpipe.runtime.comm import broadcast
    from hpcpipe.serve.engine import run
    world = MPI.COMM_WORLD
    state: dict = {}
    completion_out = sys.stdout     # stdout holds the completion alone: everything else goes to stderr

    def setup() -> tuple[ServeSetup, None]:
        p = prepare(args.weights, world.Get_size(), args.config, args.overrides)
        return p, check_request(args, p, tokenize=False)

    def body(prepared: tuple[ServeSetup, None]) -> int:
        p = prepared[0]

        def open_source() -> OneShot:     # rank 0, in an agreement: a prompt refused is every rank's one error line
            state["request"] = check_request(args, p)
            state["source"] = OneShot(state["request"], TextStream(p.tokenizer), completion_out)
            return state["source"]
        counts = run(p, world, open_source, stop)
        request = state.get("request")     # rank 0's
        stopped = world.Get_rank() == 0 and state["source"].finish == "cancelled"
        if broadcast(world, stopped):          # every rank exits 75, as rank 0 decides
            if stopped:
                print(stopped_line(counts["reason"], state["source"], request), file=sys.stderr, flush=True)
            return EXIT_PREEMPTED
        if world.Get_rank() == 0:
            source = state["source"]
            rate = counts["tokens"] / counts["seconds"] if counts["seconds"] > 0 else 0.0
            print(f"hpcpipe: generated {_tokens(len(source.tokens))} in {counts['seconds']:.2f} s "
                  f"({rate:.1f} tokens/s), finish_reason {source.finish}{full_context_note(source, request, p)}",
                  file=sys.stderr, flush=True)
            if args.json:
                write_json(args.json, {"prompt": args.prompt, "completion": source.text.text,
                                       "prompt_tokens": request.prompt, "tokens": source.tokens,
                                       "finish_reason": source.finish, "seconds": counts["seconds"],
                                       "ep_comm_s": counts["ep_comm_s"]})
        return 0

    try:
        # run_job prints the MPI line to stdout, as every command does; here it goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            return run_job(world, setup, body, lambda: f"rank {world.Get_rank()}")
    finally:
        stop.ignore()   # as train: a second signal while the ranks shut down must not kill one
