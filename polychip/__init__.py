"""polychip: an LLM inference server where the hardware is a plugin."""
__version__ = "0.1.0"


def __getattr__(name):
    # lazy, so `import polychip` stays cheap for the CLI and plugins
    if name in ("LLM", "SamplingParams"):
        from polychip.engine import llm, sampling_params
        return {"LLM": llm.LLM, "SamplingParams": sampling_params.SamplingParams}[name]
    raise AttributeError(name)
