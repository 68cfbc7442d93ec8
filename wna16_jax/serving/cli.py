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
from typing import Any

from ..errors import ConfigError
from ..fields import check_int

#: the description ``wna16-jax serve --help`` prints
DESCRIPTION = ("Serve the model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models,\n"
               "/health, /metrics): continuous batching over a paged KV cache. Binds the loopback unless --host\n"
               "says otherwise; Ctrl-C stops it. Needs the serve extra (pip install 'wna16-jax[serve]').")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``serve`` to ``subparsers`` (the ``add_subparsers()`` of the ``wna16-jax`` parser)."""
    from ..cli import DTYPES, _add_model_arguments, _HelpFormatter

    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server over the paged model engine",
                              description=DESCRIPTION, formatter_class=_HelpFormatter)
    _add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV-cache block")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV-cache blocks in the pool; None: what 0.9 of the device's free memory holds, at most "
                        "what the largest batch of the longest sequences uses")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length in tokens, a multiple of --block-size; None: max_position_embeddings, "
                        "at most 4096")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="activation dtype; None: float32 on the CPU, bfloat16 on GPUs")
    p.add_argument("--model-name", default=None, help="the model id clients name; None: DIR as given")
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
        "num_blocks": None if args.num_blocks is None else check_int("--num-blocks", args.num_blocks, low=2),
        "max_model_len": None if args.max_model_len is None else check_int("--max-model-len", args.max_model_len,
                                                                           low=1),
        "name": name,
    }


def run_serve(args: argparse.Namespace, *, err=None) -> int:
    """Serve the model of ``args.path`` (the ``serve`` subcommand's namespace) until stopped;
    what was loaded and where it listens go to ``err`` (default stderr). Returns 0."""
    from ..cli import _load_model, _tokenizer
    from ..hub import resolve_model_dir
    from . import server                          # the serve extra: refused here, before loading
    from .model_engine import ModelEngine

    err = err or sys.stderr
    opts = _checked_options(args)
    folder = resolve_model_dir(args.path, revision=args.revision)
    tok = _tokenizer(folder, "serve", "the server reads and answers text; use a folder with its tokenizer")
    model, loaded = _load_model(folder, args.dtype)
    engine = ModelEngine(model, block_size=opts["block_size"], num_blocks=opts["num_blocks"],
                         max_model_len=opts["max_model_len"])
    app = server.create_app(engine, tok, opts["name"])
    print(f"{loaded}; {engine!r}; serving {opts['name']!r} on http://{args.host}:{opts['port']}/v1", file=err,
          flush=True)
    server.serve(app, host=args.host, port=opts["port"])
    return 0


__all__ = ["add_serve_parser", "run_serve", "DESCRIPTION"]
