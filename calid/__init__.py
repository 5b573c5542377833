"""calid: serve a large target model faster with a small draft model.

``calid.Engine`` runs every decoding mode in-process (no Ray); ``calid.open_model``
opens a preset, a local folder, a GGUF file or a hub id on the fastest backend for
the machine (llama.cpp or torch); ``calid.load_model`` loads it into torch.
"""
__version__ = "0.1.0"

__all__ = ["Engine", "open_model", "load_model", "GenerationRequest", "SamplingParams", "DecodeParams"]


def __getattr__(name):  # lazy: `calid --help` and the gRPC client stay free of torch imports
    if name == "Engine":
        from calid.engine import Engine

        return Engine
    if name == "open_model":
        from calid.backends import open_model

        return open_model
    if name == "load_model":
        from calid.models.loader import load_model

        return load_model
    if name in ("GenerationRequest", "SamplingParams"):
        import calid.generation as g

        return getattr(g, name)
    if name == "DecodeParams":
        from calid.decoding.modes import DecodeParams

        return DecodeParams
    raise AttributeError(name)
