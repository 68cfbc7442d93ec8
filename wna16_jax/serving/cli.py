"""``wna16-jax serve DIR``: the OpenAI-compatible server over a :class:`~.model_engine.ModelEngine`.

:func:`add_serve_parser` adds the subcommand to the ``wna16-jax`` parser's subcommands and
:func:`run_serve` runs it: DIR resolved as every command resolves it
(:func:`~wna16_jax.hub.resolve_model_dir`), its tokenizer and model loaded, the paged engine made
(its pool sized from the device's free memory unless ``--num-blocks``), then
:func:`~wna16_jax.serving.server.serve` until Ctrl-C. Every option is checked before the model
is loaded; a folder without ``tokenizer.json`` is refused (the server answers in text).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..errors import ConfigError
from ..fields import check_int

#: the description ``wna16-jax serve --help`` prints
DESCRIPTION = ("Serve the model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models,\n"
               "/health, /metrics): continuous batching over a paged KV cache. Binds the loopback unless --host\n"
               "says otherwise; Ctrl-C stops it. Needs the serve extra (pip install 'wna16-jax[serve]').")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``serve`` to ``subparsers`` (the ``add_subparsers()`` of the ``wna16-jax`` parser)."""
    from ..cli import DTYPES, add_mesh_argument, add_model_arguments, HelpFormatter

    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server over the paged model engine",
                              description=DESCRIPTION, formatter_class=HelpFormatter)
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV-cache block")
    p.add_argument("--kv-blocks", "--num-blocks", dest="num_blocks", type=int, default=None,
                   help="KV-cache blocks in the pool; None: what 0.9 of the device's free memory holds, at most "
                        "what the largest batch of the longest sequences uses")
    p.add_argument("--max-batch", type=int, default=32,
                   help="most sequences decoded together; decode programs are compiled for 1, 2, 4, ... and this")
    p.add_argument("--warm-up", action="store_true",
                   help="compile every program before listening (slower start, no compile on the first requests)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length in tokens, a multiple of --block-size; None: max_position_embeddings, "
                        "at most 4096")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="activation dtype; None: float32 on the CPU, bfloat16 on GPUs")
    p.add_argument("--model-name", default=None, help="the model id clients name; None: DIR as given")
    add_mesh_argument(p)
    return p


def _checked_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's and the socket's options, checked before anything is loaded."""
    if not isinstance(args.host, str) or not args.host:
        raise ConfigError(f"--host: expected an address, got {args.host!r}")
    name = args.path if args.model_name is None else args.model_name
    if not isinstance(name, str) or not name:
        raise ConfigError(f"--model-name: expected a non-empty name, got {name!r}")
    return {
        "port": check_int("--port", args.port, low=1, high=65535),
        "block_size": check_int("--block-size", args.block_size, low=1),
        "num_blocks": None if args.num_blocks is None else check_int("--kv-blocks", args.num_blocks, low=2),
        "max_model_len": None if args.max_model_len is None else check_int("--max-model-len", args.max_model_len,
                                                                           low=1),
        "batch_sizes": batch_sizes(check_int("--max-batch", args.max_batch, low=1, high=MAX_BATCH)),
        "name": name,
    }


#: the largest ``--max-batch``
MAX_BATCH = 4096


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The compiled decode batch sizes of ``--max-batch N``: the powers of two below ``N``, and ``N``."""
    return tuple(1 << i for i in range((max_batch - 1).bit_length()) if 1 << i < max_batch) + (max_batch,)


def run_serve(args: argparse.Namespace, *, err=None) -> int:
    """Serve the model of ``args.path`` (the ``serve`` subcommand's namespace) until stopped;
    what was loaded and where it listens go to ``err`` (default stderr). Returns 0."""
    from ..cli import cli_tokenizer, load_cli_model
    from ..hub import resolve_model_dir
    from . import server                          # the serve extra: refused here, before loading
    from .model_engine import ModelEngine

    err = err or sys.stderr
    opts = _checked_options(args)
    folder = resolve_model_dir(args.path, revision=args.revision)
    tok = cli_tokenizer(folder, "serve", "the server reads and answers text; use a folder with its tokenizer")
    model, loaded = load_cli_model(folder, args.dtype, args.mesh)
    engine = ModelEngine(model, block_size=opts["block_size"], num_blocks=opts["num_blocks"],
                         max_model_len=opts["max_model_len"], batch_sizes=opts["batch_sizes"])
    if args.warm_up:
        t0 = time.perf_counter()
        engine.warm_up()
        print(f"compiled the serving programs in {time.perf_counter() - t0:.1f} s", file=err, flush=True)
    app = server.create_app(engine, tok, opts["name"])
    print(f"{loaded}; {engine!r}; serving {opts['name']!r} on http://{args.host}:{opts['port']}/v1", file=err,
          flush=True)
    server.serve(app, host=args.host, port=opts["port"])
    return 0


__all__ = ["add_serve_parser", "batch_sizes", "run_serve", "DESCRIPTION", "MAX_BATCH"]
