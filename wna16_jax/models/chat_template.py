"""Chat templates rendered the way transformers renders them: jinja2's sandbox, bounded.

A checkpoint's chat template (``tokenizer_config.json``'s ``chat_template`` or a
``chat_template.jinja`` file) is Jinja code from the folder, so it is treated as untrusted. It is
rendered in ``jinja2.sandbox.ImmutableSandboxedEnvironment`` configured as transformers 5
configures its own (observed in transformers 5.25):

* ``trim_blocks=True``, ``lstrip_blocks=True``, the ``loopcontrols`` extension (``{% break %}``,
  ``{% continue %}``), and a ``{% generation %}...{% endgeneration %}`` block (transformers marks
  assistant text with it; here it renders its body unchanged);
* globals ``raise_exception(message)`` (the template refuses the conversation),
  ``strftime_now(format)`` (the local time, ``datetime.now().strftime``), ``dict`` (makes a dict;
  ``dict.fromkeys``) and ``namespace`` (jinja2's, refusing names that start with ``_``);
* a ``tojson`` filter as ``json.dumps(value, ensure_ascii=False, indent=None, separators=None,
  sort_keys=False)`` with those four options: no HTML escaping, unlike jinja2's own ``tojson``.

:class:`ChatTemplate` compiles one template; :func:`checked_messages` and :func:`plain_value`
check what is handed to it (plain JSON-like data only, copied: the caller's objects are never
mutated nor exposed to the template).

Every refusal is a :class:`~wna16_jax.errors.ConfigError` naming the template (``where``): a
syntax error (with its line), ``raise_exception`` (with the template's message), an attempt to
leave the sandbox (any attribute the sandbox deems unsafe — ``__class__``, ``__globals__``,
``cycler.__init__`` ... — is refused at once, before anything is called; transformers' sandbox
instead returns an undefined value there, which only fails when printed), an undefined value
used, and any error while rendering (with the template line where known).

Bounds. jinja2's sandbox blocks unsafe attributes, caps ``range()`` at ``jinja2.sandbox.MAX_RANGE``
(100 000 items) and lets an environment intercept operators; it does not bound time or size. A
render here is stopped (a :class:`~wna16_jax.errors.ConfigError` saying which bound) when it:

* takes more than :data:`MAX_RENDER_STEPS` steps — a step is one ``for``-loop iteration
  (recursive loops included) or one call (macros, functions, methods);
* produces more than :data:`MAX_RENDER_CHARS` characters and items in all: every piece of text
  written (output, and text captured by macros, ``{% set %}`` blocks and filter blocks) and every
  value built by ``~``, an operator, a filter or a call is counted when made (a string by its
  length, a list / dict by its items and their contents); the operations whose result can be a
  large multiple of their inputs (``*``, ``str.replace`` / ``join`` / ``center`` / ``ljust`` /
  ``rjust`` / ``zfill`` / ``expandtabs`` / ``translate``, ``int.to_bytes``, the ``replace`` /
  ``join`` / ``center`` / ``indent`` / ``wordwrap`` / ``sum`` filters, ``lipsum``) are charged
  *before* they run, so such a result is never built when it would pass the bound, and
  ``tojson`` is charged piece by piece as it is built;
* builds an integer of more than :data:`MAX_INT_BITS` bits (``**`` and ``*`` are checked first),
  or formats with a width or precision above :data:`MAX_FORMAT_WIDTH` (``%``, ``|format``,
  ``str.format``); the ``batch`` / ``slice`` filters' counts are capped like ``range()``;
* runs for more than :data:`MAX_RENDER_SECONDS` seconds (checked at every step: a backstop).

The filter ``urlize`` is not available (its output can be any multiple of its input and chat
templates do not use it). jinja2 is imported only when a template is compiled.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import inspect
import json
import re
import string
import time
import traceback
from typing import Any, Mapping

import numpy as np

from ..errors import ConfigError, UnsupportedError

#: the longest template source compiled, in characters
MAX_TEMPLATE_CHARS = 1_000_000
#: loop iterations plus calls one render may take
MAX_RENDER_STEPS = 1_000_000
#: characters and items one render may produce, output and intermediate values together
MAX_RENDER_CHARS = 64 * 2**20
#: the largest integer a template may build
MAX_INT_BITS = 65_536
#: the largest width or precision in a format string
MAX_FORMAT_WIDTH = 10_000
#: wall-clock limit of one render (checked at every step)
MAX_RENDER_SECONDS = 10.0
#: the oldest jinja2 accepted: earlier releases have known sandbox escapes
MIN_JINJA2 = (3, 1, 6)

_INSTALL = "pip install 'wna16-jax[models]'"
#: the globals the rewritten templates call (see :func:`_instrument`)
_ITER, _EMIT, _CONCAT = "_wna16_iter", "_wna16_emit", "_wna16_concat"
#: the multiplicative str / bytes methods, checked before they run
_PADDING_METHODS = ("center", "ljust", "rjust", "zfill")
#: jinja2 filters left out of the environment (see the module doc)
_DROPPED_FILTERS = ("urlize",)
#: how deep plain_value follows nested lists and mappings
_MAX_DEPTH = 64
#: the most parts the batch / slice filters may make (jinja2's range cap)
_MAX_PARTS = 100_000


class _LimitExceeded(Exception):
    """A render bound was reached (internal: becomes a ConfigError at the render boundary)."""


class _TemplateRaised(Exception):
    """The template called ``raise_exception(message)``."""


class _Budget:
    """One render's counters (see the module doc); the current one lives in :data:`_BUDGET`."""

    __slots__ = ("steps", "chars", "deadline")

    def __init__(self):
        self.steps, self.chars = 0, 0
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_RENDER_STEPS:
            raise _LimitExceeded(f"more than MAX_RENDER_STEPS = {MAX_RENDER_STEPS} steps (loop iterations and "
                                 "calls)")
        if time.monotonic() > self.deadline:
            raise _LimitExceeded(f"more than MAX_RENDER_SECONDS = {MAX_RENDER_SECONDS} s")

    def charge(self, n: int) -> None:
        """Count ``n`` characters / items about to be (or just) produced."""
        self.chars += n
        if self.chars > MAX_RENDER_CHARS:
            raise _LimitExceeded(f"more than MAX_RENDER_CHARS = {MAX_RENDER_CHARS} characters and items produced")

    def left(self) -> int:
        return MAX_RENDER_CHARS - self.chars


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("wna16_chat_template_budget")


def _budget() -> _Budget:
    b = _BUDGET.get(None)
    if b is None:                        # a template object used outside ChatTemplate.render
        raise _LimitExceeded("rendering outside ChatTemplate.render")
    return b


def _size(value: Any, limit: int) -> int:
    """Characters plus items of ``value`` (strings by length, containers by items and contents);
    stops counting once past ``limit``, so the walk itself is bounded."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes, bytearray)):
            total += len(v)
        elif isinstance(v, Mapping):
            total += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v)
            stack.extend(v)
        else:
            total += 1
    return total


def _charge_value(value: Any) -> Any:
    """Charge a value just built to the current render, and return it."""
    b = _budget()
    b.charge(_size(value, b.left()))
    return value


def _check_int_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise _LimitExceeded(f"an integer of about {bits} bits (more than MAX_INT_BITS = {MAX_INT_BITS})")


def _check_width(kind: str, digits: str) -> None:
    if len(digits) > 6 or int(digits) > MAX_FORMAT_WIDTH:
        raise _LimitExceeded(f"a {kind} of {digits[:12]} in a format (more than MAX_FORMAT_WIDTH = "
                             f"{MAX_FORMAT_WIDTH})")


_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(fmt: str) -> None:
    """``fmt % args`` (and ``|format``): widths and precisions at most MAX_FORMAT_WIDTH, no ``*``."""
    for m in _PRINTF.finditer(fmt):
        for kind, g in zip(("width", "precision"), m.groups()):
            if g == "*":
                raise _LimitExceeded("a '*' width or precision in a format (the width would come from the data)")
            if g:
                _check_width(kind, g)


def _check_str_format(fmt: str) -> None:
    """``str.format`` / ``format_map``: no nested fields in a format spec, numbers within MAX_FORMAT_WIDTH."""
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec:
            if "{" in spec:
                raise _LimitExceeded("a nested field in a str.format spec")
            for digits in re.findall(r"\d+", spec):
                _check_width("width or precision", digits)


def _joined_size(items: list, sep_len: int) -> int:
    return sum(len(x) if isinstance(x, (str, bytes, bytearray)) else len(str(x)) for x in items) + \
        max(len(items) - 1, 0) * sep_len


def _replaced_size(s: str, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, (str, bytes)) or not isinstance(new, (str, bytes)) or type(old) is not type(s):
        return len(s)                    # the call itself refuses mixed types
    hits = len(s) + 1 if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _method_precheck(func: Any, args: tuple, kwargs: dict) -> tuple:
    """Charge (before the call) what a multiplicative str / bytes / int method would build;
    returns the arguments to call with (``join``'s iterable materialized once)."""
    owner, name = getattr(func, "__self__", None), getattr(func, "__name__", "")
    b = _budget()
    wrapped = getattr(func, "__wrapped__", None)    # the sandbox's str.format / format_map wrapper
    if isinstance(getattr(wrapped, "__self__", None), str) and getattr(wrapped, "__name__", "") in (
            "format", "format_map"):
        _check_str_format(wrapped.__self__)
        return args
    if isinstance(owner, (str, bytes, bytearray)):
        if name in _PADDING_METHODS and args and isinstance(args[0], int):
            b.charge(max(args[0], len(owner)))
        elif name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(tab, int):
                b.charge(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * max(tab, 0))
        elif name == "replace" and len(args) >= 2:
            b.charge(_replaced_size(owner, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count")))
        elif name == "join" and len(args) == 1:
            items = list(args[0])
            b.charge(_joined_size(items, len(owner)))
            return (items,)
        elif name == "translate" and args and isinstance(args[0], Mapping):
            longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
            b.charge(len(owner) * max(longest, 1))
    elif isinstance(owner, int) and name == "to_bytes":
        length = args[0] if args else kwargs.get("length", 1)
        if isinstance(length, int):
            b.charge(length)
    return args


# --------------------------------------------------------------------------- the template data


def plain_value(name: str, value: Any, depth: int = 0) -> Any:
    """``value`` copied as plain JSON-like data (str, int, float, bool, None, lists, and mappings
    with string keys; tuples become lists), or a :class:`ConfigError` naming ``name`` (the path of
    the offending item, ``messages[2]['content']`` say). Nothing else reaches a template."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, np.generic) and isinstance(value.item(), (bool, int, float, str)):
        return value.item()              # numpy scalars (np.int64, np.bool_, ...) as Python values
    if depth >= _MAX_DEPTH:
        raise ConfigError(f"{name}: nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{name}: keys must be strings, got key {k!r} ({type(k).__name__})")
            out[str.__str__(k)] = plain_value(f"{name}[{k!r}]", v, depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [plain_value(f"{name}[{i}]", v, depth + 1) for i, v in enumerate(value)]
    raise ConfigError(f"{name}: expected plain data (str, int, float, bool, None, lists and mappings), got "
                      f"{type(value).__name__}")


#: the names transformers reads a message's reasoning from (the first is the one templates use)
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def checked_messages(messages: Any, name: str = "messages") -> list[dict]:
    """``messages`` — a non-empty list of mappings, each with a string ``role`` and a string
    ``content`` (other keys: plain data) — as fresh dicts, with transformers' normalization:
    keys whose value is None are dropped, and a message carrying its reasoning under
    ``reasoning_content``, ``thinking`` or ``reasoning`` gets it under ``reasoning_content`` and
    (unless it has its own) ``thinking`` too. Refusals name the message (``messages[1]``)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, (list, tuple)):
        raise ConfigError(f"{name}: expected a list of {{'role': str, 'content': str}} mappings, got "
                          f"{type(messages).__name__}")
    if not messages:
        raise ConfigError(f"{name}: expected at least one message, got an empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(m, Mapping):
            raise ConfigError(f"{where}: expected a mapping with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if m.get(key) is None else f"{type(m[key]).__name__} {m[key]!r}"[:80]
                raise ConfigError(f"{where}: field {key!r} must be a string, got {got}")
        msg = {k: v for k, v in plain_value(where, m).items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_KEYS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


# --------------------------------------------------------------------------- the environment


def _import_jinja2():
    try:
        import jinja2
    except ImportError:
        raise UnsupportedError(f"chat templates: rendering one needs the 'jinja2' package ({_INSTALL}), "
                               "which is not installed") from None
    version = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < MIN_JINJA2:
        raise UnsupportedError(f"chat templates: jinja2 {jinja2.__version__} has known sandbox escapes; "
                               f"jinja2 >= {'.'.join(map(str, MIN_JINJA2))} is needed (pip install -U jinja2)")
    return jinja2


#: the filters whose result can be a large multiple of their input: charged before they run
_PRECHECKED_FILTERS = ("replace", "join", "center", "indent", "wordwrap", "format", "batch", "slice", "sum")


def _bounded_filter(name: str, func):
    """A jinja2 filter that charges its result (and, for the multiplicative ones, its result's
    size before it runs) to the current render."""
    has_pass_arg = getattr(func, "jinja_pass_arg", None) is not None    # context / eval_ctx / environment first
    if name not in _PRECHECKED_FILTERS:
        @functools.wraps(func)
        def charged(*args, **kwargs):
            return _charge_value(func(*args, **kwargs))

        return charged
    sig = inspect.signature(func)         # jinja2's async variants hide their pass argument from it
    sig_has_pass_arg = next(iter(sig.parameters), "") in ("context", "eval_ctx", "environment")
    at = 1 if has_pass_arg else 0         # where the filtered value is in the call's arguments

    @functools.wraps(func)
    def bounded(*args, **kwargs):
        b = _budget()
        a = sig.bind(*(args if sig_has_pass_arg or not has_pass_arg else args[1:]), **kwargs)
        a.apply_defaults()
        p, value = a.arguments, args[at]
        if name in ("join", "sum"):       # materialized once, so that it can be measured
            value = list(value)
            args = (*args[:at], value, *args[at + 1:])
        if name == "replace":
            s = str(value)
            b.charge(_replaced_size(s, str(p["old"]), str(p["new"]), p["count"]))
        elif name == "join":
            b.charge(_joined_size(value, len(str(p["d"]))))
        elif name == "center" and isinstance(p["width"], int):
            b.charge(p["width"])
        elif name == "indent":
            w = p["width"] if isinstance(p["width"], int) else len(str(p["width"]))
            s = str(value)
            b.charge(len(s) + max(w, 0) * (s.count("\n") + 1))
        elif name == "wordwrap":
            s = str(value)
            b.charge(len(s) + (len(s) + 1) * len(p["wrapstring"] or "\n"))
        elif name == "format":
            _check_printf(str(value))
        elif name in ("batch", "slice"):
            count = p["linecount" if name == "batch" else "slices"]
            if isinstance(count, int) and count > _MAX_PARTS:
                raise _LimitExceeded(f"|{name}({count}): more than {_MAX_PARTS} parts")
        elif name == "sum" and not isinstance(p["start"], (int, float)):
            b.charge(sum(_size(x, b.left()) for x in value) + _size(p["start"], b.left()))
        return _charge_value(func(*args, **kwargs))

    return bounded


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson``: ``json.dumps`` with these four options (no HTML escaping), built
    piece by piece so that its size is charged as it grows (an indent is at most
    MAX_FORMAT_WIDTH wide)."""
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    if width > MAX_FORMAT_WIDTH:
        raise _LimitExceeded(f"a tojson indent of {width} (more than MAX_FORMAT_WIDTH = {MAX_FORMAT_WIDTH})")
    b, parts = _budget(), []
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    for chunk in encoder.iterencode(value):
        b.charge(len(chunk))
        parts.append(chunk)
    return "".join(parts)


def _raise_exception(message: Any = "") -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return _charge_value(datetime.datetime.now().strftime(fmt))


def _counted(iterable: Any):
    """A ``for`` loop's iterable, one step per item."""
    b = _budget()
    for item in iterable:
        b.step()
        yield item


def _emit(part: Any) -> str:
    """The text of one piece of output (``{{ ... }}`` or literal text), charged."""
    text = part if type(part) is str else str(part)
    _budget().charge(len(text))
    return text


def _concat(*parts: Any) -> str:
    """``a ~ b ~ ...``, its size charged before it is joined."""
    texts = [p if type(p) is str else str(p) for p in parts]
    _budget().charge(sum(len(t) for t in texts))
    return "".join(texts)


class _TemplateDict:
    """The template's ``dict``: ``dict(...)`` and ``dict.fromkeys(...)`` and nothing else (no
    attribute of the real ``dict`` type to reach through)."""

    def __call__(self, *args, **kwargs):
        return _charge_value(dict(*args, **kwargs))

    def fromkeys(self, *args, **kwargs):
        return _charge_value(dict.fromkeys(*args, **kwargs))


@functools.lru_cache(maxsize=1)
def _environment():
    """The one sandboxed environment (built on first use; budgets are per render)."""
    jinja2 = _import_jinja2()
    from jinja2 import ext, nodes, sandbox, utils

    def public_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise sandbox.SecurityError(f"a namespace attribute may not start with '_', got {name!r}")

    class Namespace(utils.Namespace):
        """jinja2's ``namespace``, refusing attribute names that start with an underscore."""

        def __init__(*args, **kwargs):           # jinja2's own signature: ``namespace(self=1)`` works
            attrs = dict(*args[1:], **kwargs)
            for k in attrs:
                public_name(k)
            utils.Namespace.__init__(args[0], attrs)

        def __setitem__(self, name, value):
            public_name(name)
            utils.Namespace.__setitem__(self, name, value)

    class GenerationBlock(ext.Extension):
        """``{% generation %}...{% endgeneration %}``: the body, rendered as it is."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class Environment(sandbox.ImmutableSandboxedEnvironment):
        """transformers' environment, plus the bounds of the module doc."""

        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, operator, left, right):
            b = _budget()
            if operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                    b.charge(_size(seq, b.left()) * max(n, 0))
                elif isinstance(left, int) and isinstance(right, int):
                    _check_int_bits(abs(left).bit_length() + abs(right).bit_length())
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                    and abs(left) > 1:
                _check_int_bits(abs(left).bit_length() * min(right, MAX_INT_BITS + 1))
            elif operator == "%" and isinstance(left, str):
                _check_printf(left)
            return _charge_value(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
            _budget().step()
            args = _method_precheck(__obj, args, kwargs)
            return _charge_value(super().call(__context, __obj, *args, **kwargs))

        def unsafe_undefined(self, obj, attribute):
            raise sandbox.SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object "
                                        "is unsafe")

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, ext.loopcontrols])
    for name in _DROPPED_FILTERS:
        env.filters.pop(name, None)
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters["tojson"] = _tojson
    lipsum = env.globals["lipsum"]

    def bounded_lipsum(n=5, html=True, min=20, max=100):
        if isinstance(n, int) and isinstance(max, int):
            _budget().charge(n * max * 12)
        return lipsum(n, html, min, max)

    env.globals.update({"raise_exception": _raise_exception, "strftime_now": _strftime_now, "dict": _TemplateDict(),
                        "namespace": Namespace, "lipsum": bounded_lipsum,
                        _ITER: _counted, _EMIT: _emit, _CONCAT: _concat})
    return jinja2, nodes, env


def _instrument(nodes, tree):
    """Rewrite a parsed template so that the bounds apply: every ``for`` loop iterates through
    ``_wna16_iter`` (as does the iterable a recursive loop is called with), every piece of output
    is written through ``_wna16_emit``, every ``~`` joins through ``_wna16_concat``."""

    def call(name, args, lineno):
        return nodes.Call(nodes.Name(name, "load"), list(args), [], None, None, lineno=lineno)

    def visit(node, recursive_loop: bool):
        if isinstance(node, nodes.For):
            inner = recursive_loop or node.recursive
            node.iter = call(_ITER, [visit(node.iter, recursive_loop)], node.lineno)
            node.body = [visit(n, inner) for n in node.body]
            node.else_ = [visit(n, recursive_loop) for n in node.else_]
            if node.test is not None:
                node.test = visit(node.test, recursive_loop)
            node.target = visit(node.target, recursive_loop)
            return node
        for field, value in node.iter_fields():
            if isinstance(value, list):
                setattr(node, field, [visit(v, recursive_loop) if isinstance(v, nodes.Node) else v for v in value])
            elif isinstance(value, nodes.Node):
                setattr(node, field, visit(value, recursive_loop))
        if isinstance(node, nodes.Output):
            node.nodes = [call(_EMIT, [n], n.lineno) for n in node.nodes]
        elif isinstance(node, nodes.Concat):
            return call(_CONCAT, node.nodes, node.lineno)
        elif (recursive_loop and isinstance(node, nodes.Call) and isinstance(node.node, nodes.Name)
              and node.node.name == "loop" and len(node.args) == 1):
            node.args = [call(_ITER, node.args, node.lineno)]
        return node

    return visit(tree, False)


def _template_line(e: BaseException) -> str:
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == "<template>"]
    return f" (template line {lines[-1]})" if lines else ""


class ChatTemplate:
    """One chat template, compiled once in the sandbox (see the module doc). ``where`` names it
    in every error (``"<folder>/tokenizer_config.json: chat_template"``, say)."""

    def __init__(self, source: str, where: str):
        if not isinstance(source, str):
            raise ConfigError(f"{where}: a chat template must be a string, got {type(source).__name__}")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ConfigError(f"{where}: the chat template has {len(source)} characters, more than "
                              f"MAX_TEMPLATE_CHARS = {MAX_TEMPLATE_CHARS}")
        self.source, self.where = source, where
        jinja2, nodes, env = _environment()
        try:
            tree = _instrument(nodes, env.parse(source))
            tree.set_environment(env)
            self._template = env.from_string(tree)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"{where}: chat template syntax error at line {e.lineno}: {e.message}") from None
        except RecursionError:
            raise ConfigError(f"{where}: the chat template is nested too deeply to compile") from None
        self._jinja2 = jinja2

    def render(self, variables: Mapping[str, Any]) -> str:
        """The template rendered with ``variables`` (already plain data: see :func:`plain_value`)."""
        jinja2 = self._jinja2
        token = _BUDGET.set(_Budget())
        try:
            return self._template.render(dict(variables))
        except _TemplateRaised as e:
            raise ConfigError(f"{self.where}: the chat template refused the conversation "
                              f"(raise_exception{_template_line(e)}): {e}") from None
        except _LimitExceeded as e:
            raise ConfigError(f"{self.where}: rendering stopped{_template_line(e)}: {e}") from None
        except jinja2.exceptions.SecurityError as e:
            raise ConfigError(f"{self.where}: the chat template tried what the sandbox forbids"
                              f"{_template_line(e)}: {e}") from None
        except jinja2.exceptions.UndefinedError as e:
            raise ConfigError(f"{self.where}: the chat template used an undefined value{_template_line(e)}: "
                              f"{e}") from None
        except RecursionError:
            raise ConfigError(f"{self.where}: rendering stopped: recursion too deep") from None
        except MemoryError:
            raise ConfigError(f"{self.where}: rendering stopped: out of memory") from None
        except Exception as e:  # noqa: BLE001 - whatever the template's code raised, as a typed error
            raise ConfigError(f"{self.where}: rendering the chat template failed{_template_line(e)}: "
                              f"{type(e).__name__}: {e}") from None
        finally:
            _BUDGET.reset(token)


__all__ = ["ChatTemplate", "checked_messages", "plain_value", "MAX_TEMPLATE_CHARS", "MAX_RENDER_STEPS",
           "MAX_RENDER_CHARS", "MAX_INT_BITS", "MAX_FORMAT_WIDTH", "MAX_RENDER_SECONDS"]
