"""A package from outside the cache installs as an entry with its signed version, sharing blobs."""

from __future__ import annotations

import os

import pytest

from flare.package.convert import convert
from flare.package.install import install_package
from flare.package.reader import open_package
from flare.package.store import ModelCache
from flare.package.verify import IntegrityError
from flare.package import format as fmt


def test_a_packed_download_installs_and_loads(export, approved, tmp_path):
    entry = export()
    packed = convert(entry, tmp_path / "download.safetensors", "packed")
    other = ModelCache(tmp_path / "other-cache")
    installed = install_package(packed, other)
    assert installed.name == entry.name and other.default_version("stories260k") == entry.name
    assert (installed / "model.safetensors").read_bytes() == (entry / "model.safetensors").read_bytes()
    assert len(list(open_package(installed, approved).iter_weights())) == 47
    assert install_package(packed, other) == installed                     # the same version again
    for payload in (installed / "weights").iterdir():
        assert os.stat(payload).st_nlink == 2                               # entry + blob


def test_a_corrupt_download_installs_nothing(export, tmp_path):
    packed = convert(export(), tmp_path / "download.safetensors", "packed")
    location = fmt.read_package_files(packed).packed_locations["weights/head.safetensors"]
    with open(packed, "r+b") as handle:
        handle.seek(location.offset + location.size - 1)
        handle.write(b"\x55")
    other = ModelCache(tmp_path / "other-cache")
    with pytest.raises(IntegrityError, match="weights/head.safetensors differs"):
        install_package(packed, other)
    assert other.entries() == []
