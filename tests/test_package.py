"""The package's front door: ``import wna16_jax as wj`` gives the public API, typed, licensed."""

import os

import wna16_jax as wj

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_public_api_names_resolve():
    required = {"Checkpoint", "write_checkpoint", "QuantScheme", "QuantConfig", "select_backend", "Backend",
                "TABLE", "fused_moe", "fused_topk", "QuantizedMoE", "WNA16Error", "ConvertedCheckpoint",
                "convert_checkpoint", "Device", "BackendFallbackWarning"}
    assert required <= set(wj.__all__)
    for name in wj.__all__:
        assert getattr(wj, name) is not None, name
    assert issubclass(wj.CorruptFileError, wj.WNA16Error) and issubclass(wj.UnsafePathError, wj.WNA16Error)
    assert set(wj.__all__) <= set(dir(wj))


def test_unknown_attribute_is_an_attribute_error():
    try:
        wj.not_a_name  # noqa: B018
    except AttributeError as e:
        assert "not_a_name" in str(e)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


def test_typed_and_licensed():
    assert os.path.isfile(os.path.join(ROOT, "wna16_jax", "py.typed"))
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert "Apache License" in f.read()
