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
from enum import Enum
from typing import Any, Mapping

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


def _parse_ct(qc: Mapping[str, Any]) -> QuantScheme:
    where = "quantization_config"
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ConfigError(f"{where}.config_groups: expected a non-empty object, got {groups!r}")
    parsed = []
    top_format = qc.get("format")
    for name, group in groups.items():
        gw = f"{where}.config_groups.{name}"
        if not isinstance(group, Mapping):
            raise ConfigError(f"{gw}: expected an object, got {group!r}")
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
        parsed.append(((bits, group_size, not symmetric, actorder, strategy), name))
    distinct = {p for p, _ in parsed}
    if len(distinct) != 1:
        listed = "; ".join(f"{n}: {p}" for p, n in parsed)
        raise ConfigError(
            f"{where}.config_groups: groups with different weight schemes are not supported ({listed})"
        )
    bits, group_size, zp, actorder, strategy = parsed[0][0]
    return QuantScheme(
        QuantMethod.COMPRESSED_TENSORS, bits, group_size, zero_point=zp,
        act_order=actorder == "group" and group_size != -1,
        ct_strategy=strategy, ct_actorder=actorder,
        ignore=tuple(qc.get("ignore") or ()),
    )
