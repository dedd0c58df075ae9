"""kvedge's GGUF container reader (kvedge.models.gguf_reader) against gguf-py's own GGUFReader: every metadata
value and every tensor's info and bytes equal, on a file with every value type, and on the real SmolLM2 file
when $KVEDGE_SMOLLM2_GGUF is set."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from kvedge.models.gguf_reader import Reader  # noqa: E402


def _write(path: Path, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-6)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1.0 / 3.0)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo, ümlaut ✓")
    w.add_string("t.empty", "")
    w.add_array("t.strings", ["a", "", "Ġthe", "<|im_start|>", "日本"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.BF16):
        x = rng.standard_normal((4, 64)).astype(np.float32)
        q = gguf.quants.quantize(x, kind)
        w.add_tensor(kind.name.lower(), q, raw_shape=q.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same_as_gguf_py(path: Path) -> None:
    ref, got = gguf.GGUFReader(str(path)), Reader(path)
    stored = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # GGUFReader's header pseudo-keys
    assert list(got.fields) == list(stored)
    for key, field in stored.items():
        want, have = field.contents(), got.fields[key]
        if key == "t.nested":  # gguf-py's contents() flattens an array of arrays; this reader keeps them apart
            assert have == [[1, 2], [3]]
            have = [x for part in have for x in part]
        assert have == want, key
        assert type(have) is type(want), key
    assert [t.name for t in got.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(got.tensors, ref.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (b.tensor_type, b.n_elements, b.n_bytes,
                                                                           b.data_offset), a.name
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name
        assert np.array_equal(gguf.quants.dequantize(a.data, a.tensor_type),
                              gguf.quants.dequantize(b.data, b.tensor_type), equal_nan=True)


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_reads_as_gguf_py_reads_it(alignment, tmp_path):
    assert_same_as_gguf_py(_write(tmp_path / "all.gguf", alignment))


def test_the_real_smollm2_file_reads_as_gguf_py_reads_it():
    value = os.environ.get("KVEDGE_SMOLLM2_GGUF")
    if not value or not Path(value).is_file():
        pytest.skip("KVEDGE_SMOLLM2_GGUF is not set to the SmolLM2-135M-Instruct file (make test sets it)")
    assert_same_as_gguf_py(Path(value))


def test_a_damaged_file_is_a_value_error_not_a_crash(tmp_path):
    good = _write(tmp_path / "good.gguf").read_bytes()
    for cut in (10, 30, 200):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(good[:cut])
        with pytest.raises((ValueError, Exception)) as e:
            Reader(bad)
        assert not isinstance(e.value, (SystemError, MemoryError))
