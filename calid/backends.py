"""Choose how a model runs: execution backend (torch or llama.cpp) and dtype, from the machine.

``open_model(spec, backend, dtype, device)`` returns an :class:`OpenModel`: a
runner the workers drive (ModelRunner or LlamaCppRunner) plus the tokenizer and
EOS ids. The rules (``pick_backend``, ``pick_dtype``):

* backend ``auto``: llama.cpp on CPU for a model that comes from a GGUF file
  (presets, ``.gguf``), read in place with no dequantized copy; torch on CUDA,
  for tensor/pipeline-parallel groups, and for Hugging Face folders. When
  llama.cpp is not installed, ``auto`` says so and uses torch (never silently).
* dtype ``auto`` (torch only): bf16 on CUDA; on CPU bf16 where the CPU has
  native bf16 instructions (avx512_bf16, amx_bf16), fp32 otherwise: without
  them bf16 matmuls are emulated and slower than fp32 (``calid bench dtype``).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from calid.hugepages import describe as pages
from calid.errors import CalidError

BACKENDS = ("auto", "torch", "llamacpp")
DTYPE_CHOICES = ("auto", "fp32", "bf16")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


class BackendError(CalidError):
    """The requested backend cannot run this model here."""


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo (none where the file cannot be read)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_summary() -> str:
    """The CPU facts a benchmark prints beside its numbers."""
    info, flags = _cpuinfo(), cpu_flags()
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    kind = info.get("model name", "unknown cpu")
    if "cpu family" in info and "model" in info:  # the generation: the same name covers 3x apart in step time
        kind += f" (family {info['cpu family']} model {info['model']})"
    return (f"{kind}, {os.cpu_count()} cores, cpu flags: "
            + (" ".join(f for f in wanted if f in flags) or "none of " + ",".join(wanted))
            + f"; {pages()}")


def cpu_identity() -> str:
    """This machine's CPU model and all its flags: what a timing verdict kept on disk is valid for."""
    return f"{_cpuinfo().get('model name', 'unknown cpu')} {' '.join(sorted(cpu_flags()))}"


def native_bf16() -> bool:
    return any(f in cpu_flags() for f in NATIVE_BF16_FLAGS)


def pick_dtype(dtype: str, device: str) -> str:
    if dtype not in DTYPE_CHOICES:
        raise BackendError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPE_CHOICES)})")
    if dtype != "auto":
        return dtype
    if str(device).startswith("cuda"):
        return "bf16"
    return "bf16" if native_bf16() else "fp32"


def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def gguf_file(spec: str, show_progress: bool = True) -> Path | None:
    """The GGUF file a spec comes from (fetched for a preset), or None for folders, hub ids and self-drafts."""
    from calid.models.fetch import fetch_gguf
    from calid.models.presets import PRESETS

    if spec in PRESETS:
        return fetch_gguf(PRESETS[spec], show_progress)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise BackendError(f"GGUF file not found: {path}")
        return path
    return None


def pick_backend(backend: str, spec: str, device: str = "cpu", sharded: bool = False) -> tuple[str, str]:
    """(backend, why) for ``spec``; raises BackendError when an explicit choice cannot work."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    on_gpu = str(device).startswith("cuda")
    from_gguf = not spec.startswith("self:") and (spec.endswith(".gguf") or _is_preset(spec))
    if backend == "torch":
        return "torch", "requested"
    if backend == "llamacpp":
        problem = ("the llama.cpp backend runs on CPU here; use --backend torch for CUDA" if on_gpu else
                   "tensor/pipeline-parallel groups run on torch" if sharded else
                   f"{spec!r} is not a GGUF model (a preset or a .gguf file); use --backend torch" if not from_gguf else
                   "llama-cpp-python is not installed (pip install 'calid[cpu]')" if not llamacpp_available() else "")
        if problem:
            raise BackendError(problem)
        return "llamacpp", "requested"
    if on_gpu:
        return "torch", "auto: CUDA runs on torch"
    if sharded:
        return "torch", "auto: tensor/pipeline-parallel groups run on torch"
    if not from_gguf:
        return "torch", "auto: not a GGUF model"
    if not llamacpp_available():
        return "torch", "auto: llama-cpp-python is not installed, so the GGUF is dequantized for torch"
    return "llamacpp", "auto: GGUF model on CPU"


def _is_preset(spec: str) -> bool:
    from calid.models.presets import PRESETS

    return spec in PRESETS


@dataclass
class OpenModel:
    """A model ready for the workers: its runner, tokenizer and EOS ids, and how it runs."""

    name: str
    backend: str
    dtype: str  # torch dtype, or the GGUF's own quantization for llama.cpp ("gguf")
    runner: object  # ModelRunner | LlamaCppRunner
    tokenizer: object
    eos_ids: frozenset[int]
    path: Path  # folder with the tokenizer and config.json
    decode_read_bytes: int  # weight bytes one decode step reads
    loaded: object | None = None  # the torch LoadedModel (self-drafts share its layers)

    def describe(self) -> str:
        how = self.runner.describe() if self.backend == "llamacpp" else f"torch {self.dtype}"
        return f"{self.name} on {how}"


def open_model(spec: str, backend: str = "auto", dtype: str = "auto", device: str = "cpu",
               kv_budget_bytes: int | None = None, threads: int | None = None, show_progress: bool = True,
               log=None, graphs: str = "off", invariant: bool | None = None,
               prompt_cache: bool = True, prefill_weights: str = "auto") -> OpenModel:
    """Load ``spec`` on the chosen backend; ``log`` (default stderr) hears which one and why. ``graphs``: a
    torch model's decode graphs (ModelRunner's ``graphs``); ``invariant``: batch-invariant forwards (a row's
    logits depend only on its own sequence): a torch ModelRunner's ``invariant``, a llama.cpp runner's exact
    mode (forwards cut into calls of at most 3 rows); None: each backend's default (llama.cpp exact, torch
    not). ``prompt_cache``: a batched llama.cpp runner keeps released streams for the prefixes of later
    sequences (LlamaCppRunner; never in exact mode). ``prefill_weights``: whether a batched llama.cpp runner
    prefills prompts on unrepacked weights (calid.runtime.plain_prefill). A model opened here reads its weights
    as shipped; only ``open_draft`` may swap a draft's for a faster copy."""
    chosen, why = pick_backend(backend, spec, device)
    say = _say(log)
    if chosen == "llamacpp":
        gguf = gguf_file(spec, show_progress)
        return _open_gguf(spec, gguf, gguf, why, say, kv_budget_bytes, threads, invariant, prompt_cache,
                          prefill_weights)
    from calid.models.loader import load_model
    from calid.runtime.runner import ModelRunner

    dt = pick_dtype(dtype, device)
    lm = load_model(spec, dt, device, show_progress)
    if backend == "auto":
        say(f"[calid] {spec}: torch {dt} on {device} ({why})")
    runner = ModelRunner(lm.model, kv_budget_bytes, graphs=graphs, invariant=bool(invariant))
    return OpenModel(lm.name, "torch", dt, runner, lm.tokenizer, lm.eos_ids, lm.path, lm.decode_read_bytes, lm)


def _say(log):
    return log or (lambda line: print(line, file=sys.stderr))


def _open_gguf(spec: str, shipped: Path, weights: Path, why: str, say, kv_budget_bytes: int | None,
               threads: int | None, invariant: bool | None, prompt_cache: bool,
               prefill_weights: str = "auto") -> OpenModel:
    """``spec`` on llama.cpp, reading ``weights`` (the shipped GGUF, or a draft's copy of it); the tokenizer
    and config always come from the shipped file."""
    from calid.models.gguf_meta import gguf_companion
    from calid.models.loader import eos_token_ids, load_tokenizer
    from calid.runtime.llamacpp import LlamaCppRunner, default_threads
    from calid.runtime.prefill_weights import prefill_weights as plain_prefill

    folder = gguf_companion(spec, shipped)
    exact = invariant is not False
    plain = not exact and plain_prefill(weights, prefill_weights, threads or default_threads(), cpu_identity(), say)
    runner = LlamaCppRunner(weights, kv_budget_bytes, threads, exact=exact, prompt_cache=prompt_cache and not exact,
                            plain_prefill=plain)
    tokenizer = load_tokenizer(folder)
    say(f"[calid] {spec}: llama.cpp ({why}), {runner.describe()}")
    return OpenModel(spec, "llamacpp", "gguf", runner, tokenizer, eos_token_ids(folder, tokenizer), folder,
                     runner.weight_bytes)


def open_draft(spec: str, target, backend: str = "auto", dtype: str = "auto", device: str = "cpu",
               kv_budget_bytes: int | None = None, threads: int | None = None, show_progress: bool = True,
               log=None, invariant: bool | None = None, prompt_cache: bool = True,
               weights: str = "auto", prefill_weights: str = "auto") -> OpenModel:
    """A draft for ``target`` (an OpenModel, or the target's spec where it runs elsewhere): a model spec,
    or ``self:N``, the target's first N layers, always on torch (llama.cpp cannot run a subset of a
    model's layers). ``weights``: a llama.cpp draft's weights as shipped, as a Q4_0 copy, or (auto) the
    faster of the two here (calid.models.draft_weights)."""
    from calid.models.draft_weights import check_choice, draft_weights
    from calid.models.self_draft import parse_self_draft, self_draft
    from calid.runtime.runner import ModelRunner

    check_choice(weights)
    say = _say(log)
    layers = parse_self_draft(spec)
    if layers is not None and backend == "llamacpp":
        raise BackendError("a self-draft (self:N) runs on torch: llama.cpp cannot run a subset of a model's layers")
    chosen, why = ("torch", "self-draft") if layers is not None else pick_backend(backend, spec, device)
    if weights == "q4_0" and chosen != "llamacpp":
        raise BackendError(f"draft_weights q4_0 applies to llama.cpp models; {spec} runs on {chosen}")
    if layers is None:
        if chosen == "llamacpp":
            from calid.runtime.llamacpp import default_threads

            shipped = gguf_file(spec, show_progress)
            read = draft_weights(shipped, weights, threads or default_threads(), cpu_identity(), say)
            draft = _open_gguf(spec, shipped, read, why, say, kv_budget_bytes, threads, invariant, prompt_cache,
                               prefill_weights)
        else:
            draft = open_model(spec, backend, dtype, device, kv_budget_bytes, threads, show_progress, log,
                               invariant=invariant, prompt_cache=prompt_cache, prefill_weights=prefill_weights)
        if isinstance(target, OpenModel):
            from calid.engine import check_vocab

            check_vocab(target, draft)
        return draft
    loaded = target.loaded if isinstance(target, OpenModel) else None
    target_name = target.name if isinstance(target, OpenModel) else target
    dt = pick_dtype(dtype, device)
    if loaded is None:  # the target runs on llama.cpp or elsewhere: the self-draft needs its torch layers
        from calid.models.loader import load_model

        say(f"[calid] {spec} of {target_name}: torch {dt} (llama.cpp cannot run a subset of a model's layers)")
        loaded = load_model(target_name, dt, device, show_progress)
    model = self_draft(loaded.model, layers)
    return OpenModel(
        f"self:{layers} of {target_name}",
        "torch",
        dt,
        ModelRunner(model, kv_budget_bytes, invariant=bool(invariant)),
        loaded.tokenizer,
        loaded.eos_ids,
        loaded.path,
        loaded.decode_read_bytes * layers // max(1, loaded.config.num_layers),
        loaded,
    )


def model_facts(spec: str, backend: str = "auto", device: str = "cpu", sharded: bool = False,
                show_progress: bool = True) -> tuple[str, Path]:
    """(backend, folder with config.json and the tokenizer) for ``spec``, without loading its weights.

    A llama.cpp model needs only its GGUF's text side; a torch model its converted folder.
    """
    from calid.models.source import resolve

    chosen, _ = pick_backend(backend, spec, device, sharded)
    if chosen == "llamacpp":
        from calid.models.gguf_meta import gguf_companion

        return chosen, gguf_companion(spec, gguf_file(spec, show_progress))
    return chosen, resolve(spec, show_progress).path


def build_engine(target, draft_spec: str | None, backend: str = "auto", dtype: str = "auto", device: str = "cpu",
                 max_batch: int = 8, extra_specs: list[str] | tuple = (), draft_backend: str | None = None,
                 invariant: bool | None = None, max_forward_tokens: int | None = None, draft_weights: str = "auto"):
    """Engine over an opened target (calid.backends.OpenModel), an optional draft and extra tree drafters
    (model specs, or self:N). ``draft_backend`` defaults to ``backend``; ``max_forward_tokens``: SARATHI's
    budget per forward (needed when many prompts start together: llama.cpp refuses a forward over its batch);
    ``draft_weights``: calid.models.draft_weights."""
    from calid.engine import Engine

    if extra_specs and not draft_spec:
        raise CalidError("--extra-draft needs a main --draft")

    def runner(spec: str):
        return open_draft(spec, target, draft_backend or backend, dtype, device, invariant=invariant,
                          weights=draft_weights).runner

    return Engine(target.runner, target.tokenizer, target.eos_ids,
                  draft=runner(draft_spec) if draft_spec else None, max_batch=max_batch,
                  extra_drafts=[runner(s) for s in extra_specs], max_forward_tokens=max_forward_tokens)
