"""Offline model packages (``.pcpkg``): one tar with the weights (safetensors), config and
tokenizer (JSON), ``plan.json`` (what the engine chose on the target device) and
``manifest.json`` (format version, version matrix, every file's sha256 and size), signed with
Ed25519 in ``manifest.sig``.

A top layer (beside commands/ and server/): it packs by loading the model on the target, and
opens a package (verify, extract into a cache keyed by the manifest hash, check the device and
versions) before the engine loads the extracted folder. Nothing in a package is executed or
unpickled: it holds only safetensors, JSON and text.
"""
from polychip.package.manifest import PackageError

__all__ = ["PackageError"]
