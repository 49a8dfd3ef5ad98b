"""Tools for plugin authors that run the engine on their device: ``conformance`` (the checks a
plugin must pass), ``probe`` (a device spec walked through discovery step by step, behind
``polychip probe``) and ``numerics`` (each registered op against the native reference)."""
