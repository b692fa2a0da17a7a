"""TraCT: a CXL shared-memory KV cache for disaggregated LLM serving."""
# the one place the version is written: pyproject.toml reads it from here
__version__ = "0.1.0"


def __getattr__(name):
    # keep `import tract_cli` cheap: the C core loads on first use
    if name in ("Pool", "Geometry", "ModelProfile", "TractError", "load_model"):
        from tract_cli import core
        return getattr(core, name)
    raise AttributeError(name)
