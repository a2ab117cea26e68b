"""models/gguf_loader._Reader (the `gguf` package's reader over a plain view of its memory map,
for speed) reads every field and tensor exactly as `gguf.GGUFReader` does: the tests that compare
against transformers' GGUF loading run it under this reader too."""

from __future__ import annotations

import gguf
import numpy as np

from models.gguf_loader import _Reader


def test_reader_fields_and_tensors_equal_the_packages(tmp_path) -> None:
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 3)
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_string("general.name", "tiny ✓")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}é" for i in range(3000)])
    writer.add_array("tokenizer.ggml.merges", [f"t o{i}" for i in range(2000)])
    writer.add_array("tokenizer.ggml.scores", [float(i) / 7 for i in range(3000)])
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((64, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(32).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = _Reader(str(path)), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert mine.types == field.types and mine.name == field.name
        assert mine.contents() == field.contents(), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
    assert not isinstance(ours.data, np.memmap)  # the point of it
