"""``QuantScheme``: one immutable description of an AWQ, GPTQ or compressed-tensors checkpoint.

Parses the ``quantization_config`` block of a Hugging Face ``config.json``
(``docs/formats.md`` §1.3–§1.5, §9.1). Everything the loader, the converters and the
dispatch table need to know about the quantization lives here; fields that do not change the
tensor layout (``static_groups``, ``true_sequential``, ...) are kept for round-tripping.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from enum import Enum
from typing import Any, Iterable, Mapping

from .errors import ConfigError
from .packing import SUPPORTED_BITS


class QuantMethod(str, Enum):
    AWQ = "awq"
    GPTQ = "gptq"
    COMPRESSED_TENSORS = "compressed-tensors"

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return self.value


_GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
_CT_ACTORDERS = (None, "weight", "static", "group")


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """Weight quantization of the MoE experts of one checkpoint.

    ``group_size == -1`` means one group per output channel (channelwise).
    ``zero_point`` is True when the checkpoint stores zero points (AWQ with
    ``zero_point=True``, GPTQ ``sym=False``, compressed-tensors ``symmetric=False``);
    otherwise codes carry the implicit offset ``2**(bits-1)`` (uint4b8 / uint8b128).
    ``act_order`` is True when rows of the weight are grouped through ``g_idx``
    (GPTQ ``desc_act`` with groups, compressed-tensors ``actorder="group"``).
    """

    method: QuantMethod
    bits: int
    group_size: int
    zero_point: bool
    act_order: bool = False
    # Format details that do not change which tensors exist but are kept verbatim.
    awq_version: str | None = None
    gptq_checkpoint_format: str | None = None
    desc_act: bool = False
    static_groups: bool = False
    true_sequential: bool = True
    ct_strategy: str | None = None
    ct_actorder: str | None = None
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("method", QuantMethod(self.method))
        if self.bits not in SUPPORTED_BITS:
            raise ConfigError(f"bits: expected one of {SUPPORTED_BITS}, got {self.bits!r}")
        _group_size(self.group_size, "group_size")
        if self.act_order and self.group_size == -1:
            raise ConfigError("act_order: needs a positive group size, got group_size=-1")
        set_("ignore", tuple(self.ignore))
        if self.method is QuantMethod.AWQ:
            set_("awq_version", self.awq_version or "gemm")
        elif self.method is QuantMethod.GPTQ:
            set_("gptq_checkpoint_format", self.gptq_checkpoint_format or "gptq")
            set_("desc_act", self.desc_act or self.act_order)
        else:
            set_("ct_strategy", self.ct_strategy or ("channel" if self.group_size == -1 else "group"))
            if self.act_order:
                set_("ct_actorder", "group")

    # ------------------------------------------------------------------ derived facts
    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    @property
    def symmetric(self) -> bool:
        return not self.zero_point

    @property
    def implicit_zero(self) -> int:
        """The code offset of symmetric types: 8 for uint4b8, 128 for uint8b128."""
        return 1 << (self.bits - 1)

    @property
    def weight_type(self) -> str:
        """vLLM scalar type name of the stored codes."""
        base = f"uint{self.bits}"
        return base if self.zero_point else f"{base}b{self.implicit_zero}"

    @property
    def gptq_zeros_minus_one(self) -> bool:
        """AutoGPTQ v1 stores ``z - 1`` in ``qzeros`` (docs/formats.md §1.2)."""
        return self.method is QuantMethod.GPTQ and self.gptq_checkpoint_format != "gptq_v2"

    @property
    def weight_key(self) -> str:
        """vLLM's ``QuantKey`` for this scheme as the frontend hands it to the oracle (§9.1)."""
        if self.method is QuantMethod.AWQ:
            return "kInt4Static"  # quirk Q2: AWQ passes kInt4Static regardless of zero points
        name = f"kInt{self.bits}Static"
        if self.method is QuantMethod.COMPRESSED_TENSORS and self.bits == 4 and self.group_size == 32:
            name += "32"
        if self.zero_point and self.method is QuantMethod.COMPRESSED_TENSORS:
            name += "Asym"
        return name

    @property
    def may_have_bias(self) -> bool:
        return self.method is not QuantMethod.COMPRESSED_TENSORS  # quirk Q3

    def num_groups(self, size_k: int) -> int:
        """Number of scale groups along an input dimension of ``size_k``."""
        if self.group_size == -1:
            return 1
        return size_k // self.group_size

    def describe(self) -> str:
        g = "channel" if self.group_size == -1 else f"g{self.group_size}"
        parts = [self.method.value, f"{self.bits}-bit", g, "asym" if self.zero_point else "sym"]
        if self.act_order:
            parts.append("act-order")
        return " ".join(parts)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_quant_config(cls, qc: Mapping[str, Any]) -> "QuantScheme":
        """Parse a ``quantization_config`` mapping (AutoAWQ, AutoGPTQ or compressed-tensors)."""
        if not isinstance(qc, Mapping):
            raise ConfigError(f"quantization_config: expected a JSON object, got {type(qc).__name__}")
        method = qc.get("quant_method")
        if method == "awq":
            return _parse_awq(qc)
        if method == "gptq":
            return _parse_gptq(qc)
        if method == "compressed-tensors":
            return _parse_ct(qc)
        raise ConfigError(
            "quantization_config.quant_method: expected one of 'awq', 'gptq', "
            f"'compressed-tensors', got {method!r}"
        )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "QuantScheme":
        """Parse the quantization block of a whole ``config.json`` mapping."""
        qc = config.get("quantization_config", config.get("compression_config"))
        if qc is None:
            raise ConfigError(
                "config.json: no 'quantization_config' (or 'compression_config') block; "
                "the checkpoint is not quantized"
            )
        return cls.from_quant_config(qc)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "QuantScheme":
        """Read ``config.json`` from a checkpoint directory and parse its scheme."""
        cfg_path = os.path.join(os.fspath(path), "config.json")
        try:
            with open(cfg_path) as f:
                config = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config.json: not found in {os.fspath(path)!r}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config.json: not valid JSON ({e})") from None
        return cls.from_hf_config(config)

    # ------------------------------------------------------------------ writing
    def to_quant_config(self) -> dict[str, Any]:
        """The ``quantization_config`` block a checkpoint in this scheme carries."""
        if self.method is QuantMethod.AWQ:
            return {
                "quant_method": "awq",
                "bits": self.bits,
                "group_size": self.group_size,
                "zero_point": self.zero_point,
                "version": self.awq_version or "gemm",
                "modules_to_not_convert": list(self.ignore) or None,
            }
        if self.method is QuantMethod.GPTQ:
            return {
                "quant_method": "gptq",
                "bits": self.bits,
                "group_size": self.group_size,
                "desc_act": self.desc_act,
                "sym": not self.zero_point,
                "static_groups": self.static_groups,
                "true_sequential": self.true_sequential,
                "damp_percent": 0.01,
                "checkpoint_format": self.gptq_checkpoint_format or "gptq",
            }
        weights = {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": not self.zero_point,
            "strategy": self.ct_strategy or ("channel" if self.group_size == -1 else "group"),
            "group_size": None if self.group_size == -1 else self.group_size,
            "actorder": self.ct_actorder,
            "dynamic": False,
            "observer": "minmax",
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": None,
                    "output_activations": None,
                    "format": "pack-quantized",
                }
            },
            "ignore": list(self.ignore),
            "kv_cache_scheme": None,
        }


# ---------------------------------------------------------------------- helpers
def _field(qc: Mapping[str, Any], key: str, where: str, kinds: tuple[type, ...], default: Any = ...):
    if key not in qc or qc[key] is None:
        if default is ...:
            raise ConfigError(f"{where}.{key}: required field is missing")
        return default
    value = qc[key]
    # bool is an int subclass; refuse it where an int is meant and vice versa.
    if bool in kinds and not isinstance(value, bool):
        raise ConfigError(f"{where}.{key}: expected true/false, got {value!r}")
    if bool not in kinds and isinstance(value, bool):
        raise ConfigError(f"{where}.{key}: expected {kinds[0].__name__}, got {value!r}")
    if not isinstance(value, kinds):
        raise ConfigError(f"{where}.{key}: expected {kinds[0].__name__}, got {value!r}")
    return value


def _bits(qc: Mapping[str, Any], key: str, where: str) -> int:
    bits = _field(qc, key, where, (int,))
    if bits not in SUPPORTED_BITS:
        raise ConfigError(f"{where}.{key}: expected one of {SUPPORTED_BITS}, got {bits}")
    return bits


def _group_size(value: int, where: str) -> int:
    if value == -1 or (value > 0 and value % 8 == 0) or value in (1, 2, 4):
        if value in (1, 2, 4):
            raise ConfigError(f"{where}: group size {value} is too small (need -1 or a multiple of 8)")
        return value
    raise ConfigError(f"{where}: expected -1 (channelwise) or a positive multiple of 8, got {value}")


def _parse_awq(qc: Mapping[str, Any]) -> QuantScheme:
    where = "quantization_config"
    bits = _field(qc, "bits", where, (int,), qc.get("w_bit", ...))
    if bits != 4:
        raise ConfigError(f"{where}.bits: AutoAWQ MoE supports only 4-bit weights, got {bits}")
    group = _group_size(_field(qc, "group_size", where, (int,), qc.get("q_group_size", ...)),
                        f"{where}.group_size")
    if group == -1:
        raise ConfigError(f"{where}.group_size: AutoAWQ MoE needs a positive group size, got -1")
    zero_point = _field(qc, "zero_point", where, (bool,), True)
    version = str(qc.get("version") or "gemm").lower()
    if version != "gemm":
        raise ConfigError(
            f"{where}.version: only the 'gemm' packing is supported, got {qc.get('version')!r}"
        )
    ignore = tuple(qc.get("modules_to_not_convert") or ())
    return QuantScheme(QuantMethod.AWQ, bits, group, zero_point, False, awq_version=version,
                       ignore=ignore)


def _parse_gptq(qc: Mapping[str, Any]) -> QuantScheme:
    where = "quantization_config"
    bits = _bits(qc, "bits", where)
    group = _group_size(_field(qc, "group_size", where, (int,)), f"{where}.group_size")
    desc_act = _field(qc, "desc_act", where, (bool,), False)
    sym = _field(qc, "sym", where, (bool,), True)
    fmt = qc.get("checkpoint_format", "gptq") or "gptq"
    if fmt not in _GPTQ_CHECKPOINT_FORMATS:
        raise ConfigError(
            f"{where}.checkpoint_format: expected one of {_GPTQ_CHECKPOINT_FORMATS}, got {fmt!r}"
        )
    return QuantScheme(
        QuantMethod.GPTQ, bits, group, zero_point=not sym,
        act_order=bool(desc_act) and group != -1,
        gptq_checkpoint_format=fmt, desc_act=desc_act,
        static_groups=_field(qc, "static_groups", where, (bool,), False),
        true_sequential=_field(qc, "true_sequential", where, (bool,), True),
        ignore=tuple(qc.get("modules_to_not_convert") or ()),
    )


def _ct_groups(qc: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], QuantScheme]]:
    """Every ``config_groups`` entry of a compressed-tensors config as ``(name, targets, scheme)``."""
    where = "quantization_config"
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ConfigError(f"{where}.config_groups: expected a non-empty object, got {groups!r}")
    ignore = _string_list(qc.get("ignore"), f"{where}.ignore")
    top_format = qc.get("format")
    out = []
    for name, group in groups.items():
        gw = f"{where}.config_groups.{name}"
        if not isinstance(group, Mapping):
            raise ConfigError(f"{gw}: expected an object, got {group!r}")
        targets = _string_list(group.get("targets"), f"{gw}.targets")
        if not targets:
            raise ConfigError(f"{gw}.targets: expected a non-empty list of module names, 're:' "
                              f"patterns or class names, got {group.get('targets')!r}")
        fmt = group.get("format") or top_format
        if fmt != "pack-quantized":
            raise ConfigError(f"{gw}.format: only 'pack-quantized' is supported, got {fmt!r}")
        if group.get("input_activations") is not None:
            raise ConfigError(
                f"{gw}.input_activations: WNA16 quantizes weights only; this group also "
                f"quantizes activations ({group['input_activations']!r})"
            )
        w = group.get("weights")
        if not isinstance(w, Mapping):
            raise ConfigError(f"{gw}.weights: expected an object, got {w!r}")
        ww = f"{gw}.weights"
        bits = _bits(w, "num_bits", ww)
        wtype = w.get("type", "int")
        if wtype != "int":
            raise ConfigError(f"{ww}.type: only 'int' is supported, got {wtype!r}")
        symmetric = _field(w, "symmetric", ww, (bool,), True)
        strategy = w.get("strategy", "group" if w.get("group_size") else "channel")
        if strategy == "group":
            group_size = _group_size(_field(w, "group_size", ww, (int,)), f"{ww}.group_size")
            if group_size == -1:
                strategy = "channel"
        elif strategy == "channel":
            group_size = -1
        else:
            raise ConfigError(f"{ww}.strategy: expected 'group' or 'channel', got {strategy!r}")
        actorder = w.get("actorder")
        if actorder is True:
            actorder = "group"
        elif actorder is False:
            actorder = None
        if actorder not in _CT_ACTORDERS:
            raise ConfigError(f"{ww}.actorder: expected one of {_CT_ACTORDERS}, got {actorder!r}")
        if w.get("dynamic", False):
            raise ConfigError(f"{ww}.dynamic: dynamic weight quantization is not a checkpoint format")
        scheme = QuantScheme(
            QuantMethod.COMPRESSED_TENSORS, bits, group_size, zero_point=not symmetric,
            act_order=actorder == "group" and group_size != -1,
            ct_strategy=strategy, ct_actorder=actorder, ignore=ignore)
        out.append((str(name), targets, scheme))
    return out


def _parse_ct(qc: Mapping[str, Any]) -> QuantScheme:
    groups = _ct_groups(qc)
    if len({s for _, _, s in groups}) != 1:
        listed = "; ".join(f"{n}: {s.describe()} for {list(t)}" for n, t, s in groups)
        raise ConfigError(
            "quantization_config.config_groups: the groups quantize modules differently "
            f"({listed}); one scheme for the whole model needs module names — "
            "QuantConfig.scheme_for(name) (or Checkpoint, which picks the experts' group) resolves it"
        )
    return groups[0][2]


def _string_list(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or \
            not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
    return tuple(value)


# ---------------------------------------------------------------------- per-module schemes
def _ct_match(target: str, module: str) -> int | None:
    """How ``target`` matches ``module`` (compressed-tensors rules): 0 exact name, 1 ``re:``
    pattern (matched from the start of the name), 2 the class name ``Linear`` (every quantized
    tensor this library reads is a Linear's); None if it does not."""
    if target.startswith("re:"):
        try:
            return 1 if re.match(target[3:], module) else None
        except re.error as e:
            raise ConfigError(f"quantization_config: target {target!r} is not a valid regular "
                              f"expression ({e})") from None
    if target == module:
        return 0
    if target == "Linear":
        return 2
    return None


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's whole ``quantization_config``: which scheme quantizes which module.

    AutoAWQ and AutoGPTQ configs have one scheme (:attr:`default`), with modules left out by
    ``modules_to_not_convert`` (AWQ: any entry contained in the module name) or GPTQModel's
    ``dynamic`` rules (``"-:pattern"`` leaves matching modules unquantized; ``"+:pattern"`` or a
    bare pattern overrides ``bits`` / ``group_size`` / ``sym`` / ``desc_act`` for them).
    compressed-tensors configs map module names to groups through each group's ``targets``
    (exact name, then ``re:`` pattern, then class ``Linear``) and leave out what ``ignore``
    matches, so attention at 8 bits and experts at 4 bits is one config.
    """

    method: QuantMethod
    default: QuantScheme | None = None
    groups: tuple[tuple[str, tuple[str, ...], QuantScheme], ...] = ()
    ignore: tuple[str, ...] = ()
    dynamic: tuple[tuple[str, bool, QuantScheme | None], ...] = ()

    @classmethod
    def from_quant_config(cls, qc: Mapping[str, Any]) -> "QuantConfig":
        if not isinstance(qc, Mapping):
            raise ConfigError(f"quantization_config: expected a JSON object, got {type(qc).__name__}")
        method = qc.get("quant_method")
        if method == "compressed-tensors":
            return cls(QuantMethod.COMPRESSED_TENSORS, groups=tuple(_ct_groups(qc)),
                       ignore=_string_list(qc.get("ignore"), "quantization_config.ignore"))
        base = QuantScheme.from_quant_config(qc)
        if base.method is QuantMethod.AWQ:
            return cls(base.method, base, ignore=_string_list(qc.get("modules_to_not_convert"),
                                                              "quantization_config.modules_to_not_convert"))
        return cls(base.method, base, dynamic=_gptq_dynamic(qc, base))

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "QuantConfig":
        qc = config.get("quantization_config", config.get("compression_config"))
        if qc is None:
            raise ConfigError("config.json: no 'quantization_config' (or 'compression_config') block; "
                              "the checkpoint is not quantized")
        return cls.from_quant_config(qc)

    def scheme_for(self, module: str) -> QuantScheme | None:
        """The scheme that quantizes the Linear module ``module`` (e.g.
        ``model.layers.0.mlp.experts.3.gate_proj``), or None if it is left in 16 bits."""
        return self._resolve(module)[0]

    def group_for(self, module: str) -> str | None:
        """The name of the config group (or rule) that decides ``module``, for messages."""
        return self._resolve(module)[1]

    def _resolve(self, module: str) -> tuple[QuantScheme | None, str | None]:
        if self.method is QuantMethod.COMPRESSED_TENSORS:
            hit = next((t for t in self.ignore if _ct_match(t, module) is not None), None)
            if hit is not None:
                return None, f"ignore {hit!r}"
            best: list[tuple[int, str, QuantScheme]] = []
            for name, targets, scheme in self.groups:
                ranks = [r for r in (_ct_match(t, module) for t in targets) if r is not None]
                if ranks:
                    best.append((min(ranks), name, scheme))
            if not best:
                return None, None
            top = min(r for r, _, _ in best)
            winners = [(n, s) for r, n, s in best if r == top]
            if len({s for _, s in winners}) > 1:
                raise ConfigError(
                    f"quantization_config.config_groups: module {module!r} is matched equally by "
                    + " and ".join(f"{n} ({s.describe()})" for n, s in winners))
            return winners[0][1], winners[0][0]
        if self.method is QuantMethod.AWQ:
            hit = next((m for m in self.ignore if m and m in module), None)
            if hit is not None:
                return None, f"modules_to_not_convert {hit!r}"
            return self.default, "quantization_config"
        for pattern, positive, scheme in self.dynamic:
            if re.match(pattern, module):
                if not positive:
                    return None, f"dynamic '-:{pattern}'"
                return scheme, f"dynamic {pattern!r}"
        return self.default, "quantization_config"

    def uniform_scheme(self) -> QuantScheme:
        """The one scheme of the config (refuses compressed-tensors configs whose groups differ)."""
        if self.default is not None:
            return self.default
        schemes = {s for _, _, s in self.groups}
        if len(schemes) != 1:
            listed = "; ".join(f"{n}: {s.describe()} for {list(t)}" for n, t, s in self.groups)
            raise ConfigError(f"quantization_config.config_groups: the groups quantize modules "
                              f"differently ({listed}); ask for a module's scheme with scheme_for()")
        return next(iter(schemes))

    def experts_scheme(self, modules: "Iterable[str]", *, where: str = "config.json") -> QuantScheme:
        """The one scheme that quantizes every module in ``modules`` (the experts' Linears).

        Refuses, naming the modules and groups: an expert left unquantized (ignored, or matched
        by no group), and experts quantized by groups with different schemes.
        """
        found: dict[QuantScheme, tuple[str, str | None]] = {}
        for module in modules:
            scheme, group = self._resolve(module)
            if scheme is None:
                why = (f"listed by {group}" if group else "matched by no config group's targets")
                raise ConfigError(f"{where}: expert module {module!r} is not quantized ({why}); "
                                  "this library runs quantized experts only")
            if scheme not in found:
                found[scheme] = (module, group)
                if len(found) > 1:
                    (m0, g0), (m1, g1) = found.values()
                    s0, s1 = found
                    raise ConfigError(
                        f"{where}: the experts mix quantization schemes: {m0!r} by {g0} "
                        f"({s0.describe()}) and {m1!r} by {g1} ({s1.describe()}); one layer's "
                        "experts must share one scheme")
        if not found:
            return self.uniform_scheme()
        return next(iter(found))


def _gptq_dynamic(qc: Mapping[str, Any], base: QuantScheme) -> tuple:
    dyn = qc.get("dynamic")
    if dyn is None:
        return ()
    where = "quantization_config.dynamic"
    if not isinstance(dyn, Mapping):
        raise ConfigError(f"{where}: expected an object of pattern → overrides, got {dyn!r}")
    rules = []
    for key, overrides in dyn.items():
        positive = not key.startswith("-:")
        pattern = key[2:] if key.startswith(("-:", "+:")) else key
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"{where}: key {key!r} is not a valid regular expression ({e})") from None
        scheme = None
        if positive:
            if not isinstance(overrides, Mapping):
                raise ConfigError(f"{where}.{key}: expected an object of overrides, got {overrides!r}")
            merged = dict(base.to_quant_config())
            merged.update({k: v for k, v in overrides.items()
                           if k in ("bits", "group_size", "sym", "desc_act")})
            scheme = _parse_gptq(merged)
        rules.append((pattern, positive, scheme))
    return tuple(rules)
