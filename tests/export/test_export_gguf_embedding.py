"""A GGUF file's quantized embedding exported in its integers: the `ort` lowering gathers its rows with ONNX Runtime's
GatherBlockQuantized and computes a tied head with MatMulNBits over the same integers, so the graph holds no float
copy of the matrix. The graph is checked against the float Decoder of the same file (gguf's dequantized values,
which tests/models/test_gguf.py checks against transformers), not only against the model it was traced from."""

from __future__ import annotations

import math

import onnx
import pytest

from kvedge.export import export
from kvedge.export.prepare import ExportOptions
from kvedge.export.verify import reference, verify
from kvedge.models import load_decoder
from tests.conftest import MAX_SEQ
from tests.gguf_files import save_hf_checkpoint, write_gguf

# rows of 256 values: the K-quants need them; the blocks of 32 take them too
SHAPE = dict(hidden_size=256, intermediate_size=512, num_key_value_heads=2, head_dim=32, num_hidden_layers=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(tied: bool):
        if tied not in made:
            path = tmp_path_factory.mktemp(f"hf-tied{int(tied)}")
            save_hf_checkpoint(path, "llama", tie_word_embeddings=tied, **SHAPE)
            made[tied] = path
        return made[tied]

    return get


@pytest.mark.parametrize("qtype,tied,accuracy_level,kept", [
    ("Q4_0", True, 0, True), ("Q4_1", True, 0, True), ("Q4_K", False, 0, True), ("Q5_0", False, 0, True),
    ("Q6_K", False, 0, True),
    # a tied 8-bit head on MatMulNBits only with int8 activations (exporter.embedding_bits): float otherwise
    ("Q8_0", True, 0, False), ("Q8_0", True, 4, True)])
def test_ort_exports_the_files_embedding_in_its_integers(qtype, tied, accuracy_level, kept, checkpoint, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", checkpoint(tied), qtype)
    out = tmp_path / "out"
    sidecar = export(path, out, ExportOptions(attention="ort", max_seq_len=MAX_SEQ, verify_prompt_len=8,
                                              verify_steps=4, accuracy_level=accuracy_level))
    assert sidecar.verification["passed"], sidecar.verification
    graph = onnx.load(str(out / "model.onnx")).graph
    vocab, hidden = sidecar.model.vocab_size, sidecar.model.hidden_size
    assert [n.op_type for n in graph.node].count("GatherBlockQuantized") == int(kept)
    floats = [t.name for t in graph.initializer if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
              and math.prod(t.dims) >= vocab * hidden]
    assert len(floats) == int(not kept), floats
    heads = [n for n in graph.node if n.op_type == "MatMulNBits"
             and {a.name: a.i for a in n.attribute}["N"] == vocab]
    assert len(heads) == int(kept or not tied)  # tied: over the embedding's integers; untied: output.weight's
    float_decoder = load_decoder(path)  # the embedding as gguf's float32 values
    assert hasattr(float_decoder, "lm_head") != tied
    tolerance = {"max_rel": None, "min_cosine": 0.999} if accuracy_level else None  # int8 activations
    report = verify(reference(float_decoder, MAX_SEQ, prompt_len=8, steps=4), out, sidecar, tolerance=tolerance)
    assert report["passed"], report
    assert accuracy_level or report["max_rel_error"] < 1e-4, report
