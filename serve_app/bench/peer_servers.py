"""The servers ``calid bench peers`` runs calid against, each a subprocess on 127.0.0.1 until its block ends.

  llama-cpp-python  its own OpenAI server (``python -m llama_cpp.server``) over the llama-cpp-python build calid
                    uses (it needs the server's web packages: ``pip install 'calid[bench]'``);
  llama-server      llama.cpp's C++ server with continuous batching, in any of SPEC_CONFIGS: plain, or with one
                    of llama.cpp's own speculation methods (a draft model, n-gram lookups, or both chained).

A llama-server runs with ``--metrics``: ``spec_counters`` reads its ``llamacpp:spec_decode_*`` counters, which
``calid bench peers`` prints beside calid's own draft share.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from calid.hugepages import without_tunable

PEERS = ("llama-cpp-python", "llama-server")

# llama-server's speculation configurations, by name: what each adds to the command line ({draft}: the draft
# model's GGUF). In this llama.cpp a draft model drafts only when --spec-type names draft-simple.
SPEC_CONFIGS = {
    "plain": [],
    "draft": ["-md", "{draft}", "--spec-type", "draft-simple"],  # llama.cpp's default draft length (3)
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-mod+draft": ["-md", "{draft}", "--spec-type", "ngram-mod,draft-simple"],  # n-gram first, then the draft
}
DRAFT_N = re.compile(r"draft-n(\d+)$")  # draft-n<K>: the draft model with --spec-draft-n-max K
DEFAULT_SPEC = "plain,draft,ngram-mod,ngram-simple,ngram-mod+draft"
COUNTERS = {"drafts": "spec_decode_num_drafts_total", "drafted": "spec_decode_num_draft_tokens_total",
            "accepted": "spec_decode_num_accepted_tokens_total"}


class PeerUnavailable(Exception):
    """A peer server cannot run here (not installed, not built, did not start)."""


def check_spec_configs(names: list[str]) -> list[str]:
    """The names, checked; a CalidError names the known ones."""
    from calid.errors import CalidError

    for name in names:
        m = DRAFT_N.match(name)
        if name not in SPEC_CONFIGS and not (m and 1 <= int(m.group(1)) <= 32):
            raise CalidError(f"unknown llama-server configuration {name!r}: choose among "
                             f"{', '.join(SPEC_CONFIGS)}, draft-n<K> (K in 1..32)")
    return names


def spec_args(name: str, draft: Path | None) -> list[str]:
    """What llama-server configuration ``name`` adds to its command line; PeerUnavailable when it needs a draft
    model and the pair has none (a self-draft)."""
    m = DRAFT_N.match(name)
    args = SPEC_CONFIGS["draft"] + ["--spec-draft-n-max", m.group(1)] if m else SPEC_CONFIGS[name]
    if "{draft}" in args and draft is None:
        raise PeerUnavailable("this pair has no draft model of its own (a self-draft): nothing for -md to load")
    return [str(draft) if a == "{draft}" else a for a in args]


def spec_counters(text: str) -> dict[str, float]:
    """llama-server's speculation counters (drafts, drafted, accepted) from its Prometheus text; absent ones 0."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for key, metric in COUNTERS.items():
            if line.startswith(f"llamacpp:{metric} "):
                out[key] = float(line.split()[1])
    return out


class PeerServer:
    """A peer on 127.0.0.1:port with ``slots`` parallel sequences, up until the block ends (its log in a temp
    file); ``spec``: llama-server's speculation configuration (SPEC_CONFIGS), ``draft`` the GGUF it may draft
    with; ``hugepages``: it starts with calid's malloc huge-page tunable where calid's processes have it (else
    as its users start it, without)."""

    def __init__(self, peer: str, gguf: str, threads: int, port: int, slots: int, llama_server: str | None,
                 name: str, spec: str = "plain", draft: Path | None = None, hugepages: bool = False):
        if peer == "llama-cpp-python":
            try:
                import fastapi, sse_starlette, starlette_context, uvicorn  # noqa: F401, E401
            except ImportError as e:
                raise PeerUnavailable(f"llama_cpp.server needs its web packages ({e.name} missing): "
                                      "pip install 'calid[bench]'") from None
            self.cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", name,
                        "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096",
                        "--host", "127.0.0.1", "--port", str(port)]
        else:
            if not llama_server or not Path(llama_server).is_file():
                raise PeerUnavailable("no llama-server binary (--llama-server PATH; "
                                      "bash scripts/build_llama_server.sh builds one)")
            self.cmd = [llama_server, "-m", gguf, "-a", name, "-t", str(threads), "-tb", str(threads),
                        "-np", str(slots), "-c", str(2048 * slots), "-cb", "--metrics",
                        "--host", "127.0.0.1", "--port", str(port), *spec_args(spec, draft)]
        self.port, self.peer = port, peer
        self.env = dict(os.environ) if hugepages else without_tunable(os.environ)

    def __enter__(self):
        self.log = open(f"/tmp/calid-bench-{self.peer}.log", "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerUnavailable(f"exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2):
                    return self
            except OSError:
                time.sleep(1)
        self.__exit__()
        raise PeerUnavailable(f"not ready within 300 s (log: {self.log.name})")

    def counters(self) -> dict[str, float]:
        """llama-server's speculation counters now (zeros from a server without /metrics)."""
        if self.peer != "llama-server":
            return dict.fromkeys(COUNTERS, 0.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return spec_counters(r.read().decode())

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
