"""The one config-value validator (wna16_jax.fields): every rule refuses with a ConfigError that
names the file, the field and the value, and the accepted forms read as their Python types."""

import math

import numpy as np
import pytest

from wna16_jax.errors import ConfigError, WNA16Error
from wna16_jax.fields import REQUIRED, Fields, check_flag, check_int, check_number, check_string, show_value


def test_readers_return_python_types():
    f = Fields({"n": 8, "m": 8.0, "x": 1e-6, "b": True, "s": "silu", "l": [1, 2], "e": 2, "o": {"k": 3}},
               "config.json")
    assert f.integer("n") == 8 and type(f.integer("m")) is int
    assert f.number("x") == 1e-6 and f.number("n") == 8.0
    assert f.flag("b") is True and f.string("s", choices=("silu",)) == "silu"
    assert f.integers("l") == (1, 2) and f.integers("e", scalar=True) == (2,)
    assert f.object("o").integer("k") == 3 and f.object("o").where == "config.json: o"
    assert f.integer("absent", None) is None and f.object("absent") is None
    assert "n" in f and "absent" not in f and f.first("absent", "n") == "n"


@pytest.mark.parametrize("value, reader", [
    (True, "integer"), ("8", "integer"), (8.5, "integer"), (math.inf, "integer"), (math.nan, "integer"),
    ([8], "integer"),
    (True, "number"), ("1e-6", "number"), (math.nan, "number"), (-math.inf, "number"),
    (1, "flag"), ("true", "flag"), (0, "string"), (["a"], "string"),
    ("1,2", "integers"), ([1, "2"], "integers"), ([1, True], "integers"), ([1.5], "integers"), ({}, "integers"),
    ([1], "object"), ("x", "object"),
])
def test_wrong_types_are_refused_naming_file_field_and_value(value, reader):
    f = Fields({"k": value}, "/tmp/m/config.json")
    with pytest.raises(ConfigError) as e:
        getattr(f, reader)("k")
    msg = str(e.value)
    assert "/tmp/m/config.json" in msg and "'k'" in msg and repr(value)[:20] in msg


def test_bounds_and_required():
    f = Fields({"n": 0, "x": 0.0, "s": "gelu", "l": [1, 9]}, "config.json")
    with pytest.raises(ConfigError, match=r"'n' must be an integer >= 1, got 0"):
        f.integer("n", low=1)
    with pytest.raises(ConfigError, match=r"'x' must be a finite number > 0"):
        f.number("x", above=0)
    with pytest.raises(ConfigError, match=r"one of \['silu'\]"):
        f.string("s", choices=("silu",))
    with pytest.raises(ConfigError, match=r"<= 4"):
        f.integers("l", high=4)
    with pytest.raises(ConfigError, match=r"at most 1 entries"):
        f.integers("l", most=1)
    with pytest.raises(ConfigError, match="'absent' is required, but missing"):
        f.integer("absent")
    assert f.integer("absent", 5) == 5 and REQUIRED is not None


def test_not_an_object():
    with pytest.raises(ConfigError, match=r"generation_config.json: expected a JSON object, got list"):
        Fields([1, 2], "generation_config.json")


def test_argument_checks():
    assert check_int("max_new_tokens", np.int64(3), low=1) == 3
    assert check_number("temperature", 0, low=0) == 0.0
    for bad in (True, "3", 2.5, None, np.float32(np.nan)):
        with pytest.raises(ConfigError, match="max_new_tokens") as e:
            check_int("max_new_tokens", bad, low=1)
        assert isinstance(e.value, WNA16Error)
    with pytest.raises(ConfigError, match=r"top_p must be a finite number > 0 and <= 1, got 1.5"):
        check_number("top_p", 1.5, above=0, high=1)


def test_flag_and_string_argument_checks():
    assert check_flag("renormalize", np.bool_(False)) is False and check_flag("x", True) is True
    for bad in (0, 1, "true", None):
        with pytest.raises(ConfigError, match=rf"^renormalize must be true or false, got {show_value(bad)}$"):
            check_flag("renormalize", bad)
    assert check_string("scoring_func", "sigmoid", choices=("softmax", "sigmoid")) == "sigmoid"
    with pytest.raises(ConfigError, match=r"^scoring_func must be one of \['softmax', 'sigmoid'\], got 'tanh'$"):
        check_string("scoring_func", "tanh", choices=("softmax", "sigmoid"))
    with pytest.raises(ConfigError, match=r"^cfg: field 'name' must be a string, got 3$"):
        check_string("name", 3, where="cfg")
    long = "x" * 200
    assert len(show_value(long)) == 80 and show_value(long).endswith("...") and show_value(7) == "7"
