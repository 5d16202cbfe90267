"""Tandem: an LLM serving engine. ``tandem serve`` runs the OpenAI-compatible server;
``tandem.LLM`` runs the same engine for offline batches in Python (README, "Python API")."""

_EXPORTS = {
    "LLM": "tandem.llm",
    "SamplingParams": "tandem.llm_params",
    "StructuredOutputsParams": "tandem.llm_params",
    "RequestOutput": "tandem.llm_outputs",
    "CompletionOutput": "tandem.llm_outputs",
    "Logprob": "tandem.llm_outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """Imported on first use: ``tandem serve`` (this package's CLI) never loads the Python API."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    return getattr(importlib.import_module(_EXPORTS[name]), name)
