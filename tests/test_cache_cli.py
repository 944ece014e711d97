"""``python -m torch_tvm_gemm cache``: list, info, prune under a cap, clear, export/import."""

from __future__ import annotations

import json
import os
import tarfile

import pytest

from torch_tvm_gemm.__main__ import main
from torch_tvm_gemm.cli.cache import parse_size
from torch_tvm_gemm.kernels.gemm import GemmSpec
from torch_tvm_gemm.runtime import cache, cache_admin
from torch_tvm_gemm.runtime.table import clear_table
from torch_tvm_gemm.target import device_key


@pytest.fixture
def filled(tmp_path, monkeypatch):
    """A private cache with three small kernels, last used in the order built."""
    monkeypatch.setenv("TVM_GEMM_CACHE_DIR", str(tmp_path / "cache"))
    clear_table()
    paths = []
    for i, n in enumerate((8, 16, 24)):
        spec = GemmSpec("float32", n, 8, "nk")
        cache.load_or_build(spec)
        path = cache.kernel_path(spec)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # oldest first
        paths.append(path)
    yield paths
    clear_table()


def test_list_and_info(filled, capsys):
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert out.count("linear/gemm") == 3 and "(M,8)x(8,16) float32" in out
    assert device_key("cpu") in out and "KiB" in out
    assert main(["cache", "info"]) == 0
    assert "kernels:        3" in capsys.readouterr().out


def test_prune_respects_the_cap_and_removes_least_recently_used(filled, capsys):
    sizes = [e["size"] for e in cache_admin.entries()]
    cap = cache_admin.total_size() - min(sizes) // 2  # one kernel must go
    assert main(["cache", "prune", "--max-size", str(cap)]) == 0
    assert cache_admin.total_size() <= cap
    assert not filled[0].exists() and filled[1].exists() and filled[2].exists()
    assert "removed 1 kernel" in capsys.readouterr().out
    main(["cache", "prune", "--max-size", "0"])
    assert cache_admin.entries() == []


def test_clear(filled):
    assert main(["cache", "clear"]) == 0
    assert cache_admin.entries() == [] and not filled[0].exists()


def test_export_import_roundtrip_skips_foreign_targets(filled, tmp_path, capsys):
    archive = tmp_path / "moved.tar.gz"
    assert main(["cache", "export", str(archive)]) == 0
    # Make one kernel look built on another CPU: import must not install it.
    foreign = tmp_path / "foreign.tar.gz"
    with tarfile.open(archive) as src, tarfile.open(foreign, "w:gz") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            if m.name.endswith(filled[0].with_suffix(".json").name):
                meta = json.loads(data)
                meta["key"]["target"] = "aarch64-v128-0000000000"
                data = json.dumps(meta).encode()
                m.size = len(data)
            dst.addfile(m, __import__("io").BytesIO(data))
    main(["cache", "clear"])
    assert main(["cache", "import", str(foreign)]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "aarch64" in out
    assert not filled[0].exists()
    assert all(cache.is_intact(p) for p in filled[1:])
    main(["cache", "clear"])
    assert main(["cache", "import", str(archive)]) == 0
    assert all(cache.is_intact(p) for p in filled)


@pytest.mark.parametrize(
    ("text", "value"), [("500M", 500 << 20), ("2G", 2 << 30), ("10k", 10 << 10), ("123", 123)]
)
def test_parse_size(text, value):
    assert parse_size(text) == value
