"""`--dtype` (`jserve.model.dtype`): the served dtype over the platform table, the notes that say
when it differs from what was asked or found, and reading a source's own dtype."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import DATA
from jserve.model.dtype import DTYPE_CHOICES, check_dtype, resolve_dtype, source_dtype, storage_dtype

# (requested, source, platform) -> served dtype, and a word the note must hold (None: no note)
TABLE = [
    # auto: the checkpoint's own; a float32 one (or a quantized GGUF's) as bfloat16 on an accelerator
    ("auto", "bfloat16", "cpu", "bfloat16", None),
    ("auto", "bfloat16", "tpu", "bfloat16", None),
    ("auto", "bfloat16", "gpu", "bfloat16", None),
    ("auto", "float32", "cpu", "float32", None),
    ("auto", "float32", "tpu", "bfloat16", "float32 checkpoint is served as bfloat16 on tpu"),
    ("auto", "float32", "gpu", "bfloat16", "float32 checkpoint is served as bfloat16 on gpu"),
    ("auto", None, "cpu", "float32", None),  # a quantized GGUF on a CPU: as before
    ("auto", None, "tpu", "bfloat16", "quantized checkpoint's weights are served as bfloat16"),
    ("auto", "float16", "cpu", "bfloat16", "the checkpoint is float16: served as bfloat16 (cpu has no fast"),
    ("auto", "float16", "tpu", "bfloat16", "tpu has no fast float16"),
    ("auto", "float16", "gpu", "bfloat16", "jserve holds no float16 weights"),
    (None, "float32", "cpu", "float32", None),
    (None, "float32", "tpu", "bfloat16", "served as bfloat16"),
    # half / float16: bfloat16, said once
    ("half", "bfloat16", "cpu", "bfloat16", "float16 was asked for: served as bfloat16 (cpu has no fast float16"),
    ("float16", "float32", "tpu", "bfloat16", "tpu has no fast float16"),
    ("float16", "float16", "gpu", "bfloat16", "jserve holds no float16 weights"),
    # float32 / float, bfloat16: as asked; wider than the source is said
    ("float32", "float32", "tpu", "float32", None),
    ("float", "float32", "cpu", "float32", None),
    ("float32", "bfloat16", "cpu", "float32", "bfloat16 checkpoint is served as float32: twice its weights' memory"),
    ("float", "float16", "gpu", "float32", "float16 checkpoint is served as float32: twice"),
    ("float32", None, "cpu", "float32", None),
    ("bfloat16", "float32", "cpu", "bfloat16", None),
    ("bfloat16", "bfloat16", "tpu", "bfloat16", None),
]


@pytest.mark.parametrize("requested,source,platform,served,note", TABLE)
def test_the_served_dtype_over_the_platform_table(requested, source, platform, served, note):
    got, said = resolve_dtype(requested, source, platform)
    assert got == served
    if note is None:
        assert said is None
    else:
        assert note in said and "\n" not in said


def test_every_choice_is_served_and_a_bad_one_is_named():
    for choice in DTYPE_CHOICES:
        for platform in ("cpu", "tpu", "gpu"):
            assert resolve_dtype(choice, "bfloat16", platform)[0] in ("float32", "bfloat16")
    assert [check_dtype(c) for c in (None, "float", "half")] == ["auto", "float32", "float16"]
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, float, bfloat16, half, float16.*'fp8'"):
        resolve_dtype("fp8", "float32", "cpu")


def test_storage_keeps_the_source_where_the_served_dtype_would_lose_some():
    """A conversion into a folder not keyed by dtype is lossless: a later run may ask for more."""
    assert storage_dtype("auto", "bfloat16", "bfloat16") == "bfloat16"
    assert storage_dtype("auto", "float32", "bfloat16") == "float32"  # an accelerator's auto: cast at load
    assert storage_dtype("auto", "float16", "bfloat16") == "float32"
    assert storage_dtype("half", "float32", "bfloat16") == "float32"
    assert storage_dtype(None, None, "float32") == "float32"
    assert storage_dtype("bfloat16", "float32", "bfloat16") == "bfloat16"  # asked for by name


def test_source_dtype_of_each_kind_of_source(tmp_path):
    from safetensors.numpy import save_file

    folder = tmp_path / "hf"
    shutil.copytree(DATA / "arch" / "llama3", folder)
    assert source_dtype(folder) == "float32"  # config.json's dtype
    config = json.loads((folder / "config.json").read_text())
    del config["dtype"]
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    assert source_dtype(folder) == "bfloat16"  # the older torch_dtype
    (folder / "config.json").write_text(json.dumps(config))
    assert source_dtype(folder) == "float32"  # neither: the safetensors' own
    import ml_dtypes

    save_file({"w": np.zeros(4, ml_dtypes.bfloat16)}, folder / "model.safetensors")
    assert source_dtype(folder) == "bfloat16"
    assert source_dtype(tmp_path / "nothing") is None
    from jserve.model.named import gguf_path

    assert source_dtype(gguf_path("smollm2-135m-instruct")) is None  # Q4_1: quantized
    for file_type, want in ((0, "float32"), (1, "float16"), (32, "bfloat16"), (15, None)):
        assert source_dtype(_gguf(tmp_path / f"{file_type}.gguf", file_type)) == want
    # a converted checkpoint: its source's dtype, else (converted before it was recorded) its own
    for generation, want in (({"dtype": "float32", "source_dtype": "bfloat16"}, "bfloat16"),
                             ({"dtype": "float32", "source_dtype": None}, None), ({"dtype": "bfloat16"}, "bfloat16")):
        (tmp_path / "ckpt").mkdir(exist_ok=True)
        (tmp_path / "ckpt" / "generation.json").write_text(json.dumps(generation))
        assert source_dtype(tmp_path / "ckpt") == want


def _gguf(path, file_type: int):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(file_type)
    w.add_tensor("a.weight", np.zeros((2, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
