"""polychip: an LLM inference server where the hardware is a plugin."""
from polychip.version import __version__  # noqa: F401


def __getattr__(name):
    # lazy, so `import polychip` stays cheap for the CLI and plugins
    if name in ("LLM", "SamplingParams"):
        from polychip.engine import sampling_params
        from polychip.package import trusted_llm      # the engine's LLM behind the trust chain serve applies
        return {"LLM": trusted_llm.LLM, "SamplingParams": sampling_params.SamplingParams}[name]
    raise AttributeError(name)
