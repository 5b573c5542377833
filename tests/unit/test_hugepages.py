"""calid.hugepages: when the malloc tunable is asked for, how it is added to and taken from an environment, the
one re-execution of the calid command, and (where the kernel has THP) that a process started with it really gets
huge pages."""
import os
import subprocess
import sys

import pytest

from calid import hugepages
from calid.hugepages import REEXEC_ENV, SWITCH_ENV, TUNABLE, TUNABLES_ENV


def test_the_kernels_mode_is_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert hugepages.thp_mode(f) == "always"
    assert hugepages.thp_mode(tmp_path / "absent") is None


@pytest.mark.parametrize("env, mode, libc, reason", [
    ({}, "madvise", "glibc", None),
    ({}, "always", "glibc", None),
    ({}, "never", "glibc", "transparent huge pages never"),
    ({}, "", "glibc", "transparent huge pages unavailable"),
    ({}, "madvise", "", "not glibc"),
    ({SWITCH_ENV: "0"}, "madvise", "glibc", f"{SWITCH_ENV}=0"),
])
def test_huge_pages_are_asked_for_only_where_glibc_and_the_kernel_can_give_them(env, mode, libc, reason):
    assert hugepages.why_not(env, mode=mode, libc=libc) == reason


def test_the_tunable_joins_others_once_and_leaves_them_when_taken_out():
    assert hugepages.with_tunable({})[TUNABLES_ENV] == TUNABLE
    both = hugepages.with_tunable({TUNABLES_ENV: "glibc.malloc.arena_max=2", "PATH": "/bin"})
    assert both == {TUNABLES_ENV: f"glibc.malloc.arena_max=2:{TUNABLE}", "PATH": "/bin"}
    assert hugepages.with_tunable(both) == both
    assert hugepages.without_tunable(both) == {TUNABLES_ENV: "glibc.malloc.arena_max=2", "PATH": "/bin"}
    assert hugepages.without_tunable({TUNABLES_ENV: TUNABLE, "PATH": "/bin"}) == {"PATH": "/bin"}
    assert hugepages.active({TUNABLES_ENV: f"a=1:{TUNABLE}"}) and not hugepages.active({TUNABLES_ENV: "a=1"})


def _can(monkeypatch):
    monkeypatch.setattr(hugepages, "why_not", lambda env=os.environ: None)


def test_reexec_starts_the_same_command_line_again_with_the_tunable_once(monkeypatch):
    _can(monkeypatch)
    monkeypatch.delenv(TUNABLES_ENV, raising=False)
    monkeypatch.delenv(REEXEC_ENV, raising=False)
    calls = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    hugepages.reexec(["/usr/bin/python3", "-X", "utf8", "/venv/bin/calid", "serve", "--small"])
    [(path, argv, env)] = calls
    assert path == sys.executable
    assert argv == [sys.executable, "-X", "utf8", "/venv/bin/calid", "serve", "--small"]
    assert env[TUNABLES_ENV] == TUNABLE and env[REEXEC_ENV] == "1"


@pytest.mark.parametrize("env", [{TUNABLES_ENV: TUNABLE}, {REEXEC_ENV: "1"}, {SWITCH_ENV: "0"}])
def test_reexec_does_nothing_when_started_with_it_already_re_executed_or_switched_off(monkeypatch, env):
    if SWITCH_ENV not in env:
        _can(monkeypatch)
    for k in (TUNABLES_ENV, REEXEC_ENV, SWITCH_ENV):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("re-executed"))
    hugepages.reexec(["python", "calid", "serve"])


def test_a_failed_reexec_goes_on_with_small_pages(monkeypatch):
    _can(monkeypatch)
    monkeypatch.delenv(TUNABLES_ENV, raising=False)
    monkeypatch.delenv(REEXEC_ENV, raising=False)

    def refuse(*a):
        raise OSError("no")

    monkeypatch.setattr(os, "execve", refuse)
    hugepages.reexec(["python", "calid", "serve"])  # returns


def test_describe_names_the_pages_and_why(monkeypatch):
    _can(monkeypatch)
    assert hugepages.describe({TUNABLES_ENV: TUNABLE}).startswith(f"huge pages ({TUNABLE}")
    assert hugepages.describe({}) == f"4 KiB pages (started without {TUNABLE})"


ALLOCATE = """
import ctypes, mmap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
n = 256 << 20
p = libc.malloc(n)
ctypes.memset(p, 1, n)
print(next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')))
"""


@pytest.mark.skipif(hugepages.why_not({}) is not None, reason=f"no huge pages here: {hugepages.why_not({})}")
def test_a_process_started_with_the_tunable_gets_huge_pages_for_a_large_malloc():
    def huge_kb(env):
        out = subprocess.run([sys.executable, "-c", ALLOCATE], env=env, capture_output=True, text=True, check=True)
        return int(out.stdout)

    base = hugepages.without_tunable(os.environ)
    assert huge_kb(hugepages.with_tunable(base)) >= 128 << 10  # at least half of the 256 MiB touched
    if hugepages.thp_mode() == "madvise":  # 'always' gives huge pages without asking
        assert huge_kb(base) < 128 << 10
