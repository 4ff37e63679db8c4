"""Tests for dsv4/io/safetensors.py: every dtype round-trips, interop with `safetensors.torch` both ways,
error messages for broken files, sharded save + index reading.

Run: .venv/bin/python -m pytest -q tests/dsv4/test_safetensors_io.py
"""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4.io import safetensors as S

# safetensors dtype string -> torch dtype (the ones torch 2.13 has).
TORCH = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2, "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F8_E8M0": torch.float8_e8m0fnu,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}


def _sample(dtype_str: str, shape=(3, 5), seed=0) -> np.ndarray:
    """Random array of that dtype, built from random bytes for the float8/e8m0 types (NaN bytes avoided)."""
    dt = S.DTYPES[dtype_str]
    rng = np.random.default_rng(seed)
    if dtype_str == "BOOL":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if dt.itemsize == 1:  # float8 family and e8m0: any byte except those decoding to NaN
        b = rng.integers(0, 256, size=shape, dtype=np.uint8)
        nan = np.isnan(b.view(dt).astype(np.float32))
        return np.where(nan, np.uint8(0x3C), b).astype(np.uint8).view(dt)
    return rng.normal(size=shape).astype(dt)


def _bytes(a) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def test_every_dtype_round_trips(tmp_path):
    tensors = {f"t.{name}": _sample(name, seed=i) for i, name in enumerate(S.DTYPES)}
    tensors["scalar"] = np.array(3.5, np.float32)
    tensors["empty"] = np.zeros((0, 4), ml_dtypes.bfloat16)
    path = tmp_path / "all.safetensors"
    S.save_safetensors(path, tensors, metadata={"format": "pt", "note": "x"})
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0  # data section 8-byte aligned
    with S.SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt", "note": "x"}
        assert f.keys() == list(tensors)
        for name, a in tensors.items():
            got = f.get(name)
            assert got.dtype == a.dtype and got.shape == a.shape, name
            np.testing.assert_array_equal(_bytes(got), _bytes(a))
        assert f.info("t.F8_E8M0") == ("F8_E8M0", (3, 5))
        with pytest.raises(KeyError, match="nope"):
            f.get("nope")


def test_our_writer_is_read_by_safetensors_torch(tmp_path):
    tensors = {name: _sample(name, shape=(4, 6), seed=i) for i, name in enumerate(TORCH)}
    path = tmp_path / "ours.safetensors"
    S.save_safetensors(path, tensors)
    loaded = load_file(path)
    for name, a in tensors.items():
        t = loaded[name]
        assert t.dtype == TORCH[name] and tuple(t.shape) == a.shape, name
        np.testing.assert_array_equal(t.contiguous().view(torch.uint8).numpy().reshape(-1), _bytes(a), err_msg=name)
    # Values, not only bytes, for the types whose meaning matters here.
    np.testing.assert_array_equal(loaded["BF16"].float().numpy(), tensors["BF16"].astype(np.float32))
    np.testing.assert_array_equal(loaded["F8_E4M3"].float().numpy(), tensors["F8_E4M3"].astype(np.float32))
    np.testing.assert_array_equal(loaded["F8_E8M0"].float().numpy(), tensors["F8_E8M0"].astype(np.float32))


def test_safetensors_torch_writer_is_read_by_ours(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g)
    tensors = {
        "w.bf16": x.to(torch.bfloat16),
        "w.f8": (x * 10).to(torch.float8_e4m3fn),
        "w.scale": torch.tensor([[0.5, 4.0], [1.0, 2.0**-20]]).to(torch.float8_e8m0fnu),
        "w.f32": x,
        "w.i8": torch.randint(-128, 128, (3, 4), dtype=torch.int8, generator=g),
        "tid2eid": torch.randint(0, 256, (9, 6), dtype=torch.int64, generator=g),
    }
    path = tmp_path / "torch.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    with S.SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt"} and sorted(f.keys()) == sorted(tensors)
        for name, t in tensors.items():
            got = f.get(name)
            assert got.shape == tuple(t.shape)
            np.testing.assert_array_equal(_bytes(got), t.contiguous().view(torch.uint8).numpy().reshape(-1))
        assert f.get("w.f8").dtype == ml_dtypes.float8_e4m3fn and f.info("w.f8")[0] == "F8_E4M3"
        np.testing.assert_array_equal(f.get("w.scale").astype(np.float32), [[0.5, 4.0], [1.0, 2.0**-20]])
        np.testing.assert_array_equal(f.get("w.bf16").astype(np.float32), tensors["w.bf16"].float().numpy())


def test_broken_files_name_the_file_and_tensor(tmp_path):
    path = tmp_path / "good.safetensors"
    S.save_safetensors(path, {"a": np.arange(8, dtype=np.float32), "b": np.ones((4, 4), np.float32)})
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-10])  # last tensor truncated
    with pytest.raises(ValueError, match=r"cut\.safetensors: tensor 'b': data_offsets .* outside"):
        S.SafetensorsFile(cut)
    cut.write_bytes(data[:20])  # header truncated
    with pytest.raises(ValueError, match=r"cut\.safetensors: header length"):
        S.SafetensorsFile(cut)
    cut.write_bytes(data[:5])
    with pytest.raises(ValueError, match=r"cut\.safetensors: truncated"):
        S.SafetensorsFile(cut)
    header = json.dumps({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    cut.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(ValueError, match=r"cut\.safetensors: tensor 'a': 8 bytes do not match F32 \[3\]"):
        S.SafetensorsFile(cut)
    cut.write_bytes(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(ValueError, match=r"cut\.safetensors: bad safetensors JSON"):
        S.SafetensorsFile(cut)
    with pytest.raises(ValueError, match="no safetensors encoding"):
        S.save_safetensors(tmp_path / "c.safetensors", {"c": np.ones(2, np.complex128)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.safetensors", "good.safetensors"]  # no temp left


def test_sharded_save_and_index_reading(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {
        "layers.0.attn.wq_a.weight": _sample("F8_E4M3", (16, 32), seed=1),  # 512 B
        "layers.0.attn.wq_a.scale": np.full((1, 1), 2.0**-3).astype(ml_dtypes.float8_e8m0fnu),
        "layers.0.ffn.experts.0.w1.weight": rng.integers(-128, 128, (16, 16), dtype=np.int8),  # 256 B
        "embed.weight": rng.normal(size=(40, 16)).astype(ml_dtypes.bfloat16),  # 1280 B > max: its own shard
        "norm.weight": np.ones(16, ml_dtypes.bfloat16),
    }
    out = tmp_path / "ckpt"
    weight_map = S.save_sharded_checkpoint(out, iter(tensors.items()), max_shard_bytes=800, metadata={"step": "3"})
    files = sorted(p.name for p in out.iterdir())
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [S.INDEX_NAME]
    index = json.loads((out / S.INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    assert index["weight_map"] == weight_map and set(weight_map) == set(tensors)
    assert weight_map["embed.weight"] == "model-00002-of-00003.safetensors"
    with S.SafetensorsFile(out / weight_map["norm.weight"]) as f:
        assert f.metadata == {"format": "pt", "step": "3"}
    keys = S.checkpoint_keys(out)
    assert keys["layers.0.attn.wq_a.scale"][1:] == ("F8_E8M0", (1, 1))
    loaders = dict(S.iter_checkpoint_tensors(out))
    assert set(loaders) == set(tensors)
    for name, a in tensors.items():
        got = loaders[name]()
        assert got.dtype == a.dtype
        np.testing.assert_array_equal(_bytes(got), _bytes(a))
    # torch reads our shards too
    assert load_file(out / weight_map["embed.weight"])["embed.weight"].dtype == torch.bfloat16
    # Without the index every *.safetensors file is read.
    (out / S.INDEX_NAME).unlink()
    assert set(dict(S.iter_checkpoint_tensors(out))) == set(tensors)
    with pytest.raises(FileExistsError):
        S.save_sharded_checkpoint(out, iter(tensors.items()))


def test_index_errors(tmp_path):
    ckpt = tmp_path / "ckpt"
    S.save_sharded_checkpoint(ckpt, [("a", np.zeros(4, np.float32)), ("b", np.ones(4, np.float32))])
    index = json.loads((ckpt / S.INDEX_NAME).read_text())
    index["weight_map"]["c"] = "model-00009-of-00009.safetensors"
    (ckpt / S.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"missing: \['model-00009-of-00009.safetensors'\]"):
        list(S.iter_checkpoint_tensors(ckpt))
    index["weight_map"]["c"] = "model-00001-of-00001.safetensors"
    (ckpt / S.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"absent from the shard: \['c'\]"):
        list(S.iter_checkpoint_tensors(ckpt))
    (ckpt / S.INDEX_NAME).unlink()
    S.save_safetensors(ckpt / "extra.safetensors", {"a": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match="tensor 'a' is in both"):
        S.checkpoint_keys(ckpt)
    with pytest.raises(ValueError, match="duplicate tensor name 'x'"):
        S.save_sharded_checkpoint(tmp_path / "dup", [("x", np.zeros(1)), ("x", np.zeros(1))])
    assert not (tmp_path / "dup").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_read_region_reads_only_the_selected_bytes(tmp_path):
    """`read_region` == numpy slicing for random boxes (any dtype), and the bytes read are exactly the box's."""
    rs = np.random.default_rng(0)
    tensors = {"a": rs.standard_normal((6, 10, 12)).astype(np.float32), "b": _sample("F8_E4M3", (16, 24)),
               "c": _sample("BF16", (40,)), "s": np.float32(3.0).reshape(())}
    S.save_safetensors(tmp_path / "x.safetensors", tensors)
    with S.SafetensorsFile(tmp_path / "x.safetensors") as f:
        for name, a in tensors.items():
            for _ in range(20):
                idx = tuple(slice(int(lo), int(lo + rs.integers(0, n - lo + 1)))
                            for n in a.shape for lo in [rs.integers(0, n + 1)])
                before = S.bytes_read()
                got = f.read_region(name, idx)
                assert S.bytes_read() - before == a[idx].nbytes
                np.testing.assert_array_equal(_bytes(got), _bytes(a[idx]))
        with pytest.raises(ValueError, match=r"x\.safetensors.*'a'.*unsupported index"):
            f.read_region("a", (slice(0, 6, 2),))
