"""The ctypes mirrors of the native engine's C structs (Linear, Layer, Model in kvedge.runtime.native_backend)
against the layout the compiled engine reports (kv_layout): a mirror that drifted from kvedge_cpu.c would
hand the engine misplaced pointers, so compile_engine checks them at every load (check_layout)."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from kvedge.errors import KvedgeError
from kvedge.runtime.native_backend import Layer, Linear, Model, check_layout, compile_engine

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="the native engine needs a C compiler")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return compile_engine(cache_dir=tmp_path_factory.mktemp("native"))  # it runs check_layout on the real mirrors


def layout(dll) -> dict[str, tuple[int, int]]:
    dll.kv_layout.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
    dll.kv_layout.restype = ctypes.c_char_p
    out, at = {}, (ctypes.c_size_t * 2)()
    while (name := dll.kv_layout(len(out), at)) is not None:
        out[name.decode()] = (at[0], at[1])
    return out


def test_the_mirrors_agree_with_the_engine(engine):
    check_layout(engine)
    check_layout(engine, (Linear, Layer, Model))
    c = layout(engine)
    for st in (Linear, Layer, Model):  # the C table covers every mirrored field, and no more
        assert [k.split(".", 1)[1] for k in c if k.startswith(st._c_struct_ + ".")] == [f for f, *_ in st._fields_]
        assert c[st._c_struct_] == (0, ctypes.sizeof(st))


def mirror(name: str, fields: list) -> type[ctypes.Structure]:
    return type(name, (ctypes.Structure,), {"_c_struct_": "kv_linear", "_fields_": fields})


def swapped(i: int, j: int) -> list:
    fields = list(Linear._fields_)
    fields[i], fields[j] = fields[j], fields[i]
    return fields


@pytest.mark.parametrize("fields,match", [
    (swapped(0, 1), "at field n: C offset 0, ctypes 4"),  # n and k swapped: same types, only names tell
    (swapped(4, 5), "at field zsym: C offset 16, ctypes 24"),  # a float and a pointer swapped
    ([("n", ctypes.c_int64)] + Linear._fields_[1:], "at field n: C size 4, ctypes 8"),
    (Linear._fields_[:-1], "at field ksc: C offset 104, ctypes none"),  # a field the mirror lacks
    (Linear._fields_ + [("extra", ctypes.c_int32)], "at field extra: C offset none, ctypes 112"),
    # a mirror from before the affine linears' mins: every later field is misplaced, mins named
    ([f for f in Linear._fields_ if f[0] != "mins"], "at field w: C offset 56, ctypes 48; .*at field mins: C "
                                                     "offset 48, ctypes none"),
])
def test_a_wrong_mirror_is_refused_naming_the_field(engine, fields, match):
    with pytest.raises(KvedgeError, match=r"C struct kv_linear and its ctypes mirror BadLinear disagree .*" + match):
        check_layout(engine, (mirror("BadLinear", fields), Layer, Model))


def test_a_wrong_nested_size_shows_in_the_structs_that_hold_it(engine):
    """A mirror of Layer built on a wrong Linear: its Linear fields have the wrong size, every field after
    them the wrong offset."""
    bad = mirror("BadLinear", Linear._fields_[:-1])
    lay = type("BadLayer", (ctypes.Structure,), {"_c_struct_": "kv_layer", "_fields_": [
        (f, bad if t is Linear else t) for f, t in Layer._fields_]})
    with pytest.raises(KvedgeError, match=r"mirror BadLayer disagree in size: .*at field qkv: C size 112, ctypes 104"):
        check_layout(engine, (lay,))


@pytest.mark.parametrize("kind,per_256", [("Q4_K", 20), ("Q6_K", 18), ("Q4_0", 0), ("Q8_0", 0)])
def test_the_k_quant_records_hold_each_rows_figures_of_256_channels(engine, kind, per_256):
    """pack_gguf allocates kv_record_bytes for a K-quant's figures: per row (rows padded to the tiles' 8) and
    256 channels, Q4_K's 8 scales, 8 mins and float16 d, dmin (20 bytes), Q6_K's 16 int8 scales and float16 d
    (18 bytes, ggml-common.h's block_q6_k without its values); other types have none."""
    from kvedge.runtime.native_backend import GGUF_TYPES

    for n, k in ((13, 512), (8, 256), (49152, 2048)):
        assert engine.kv_record_bytes(n, k, GGUF_TYPES[kind]) == (n + 7) // 8 * 8 * (k // 256) * per_256
