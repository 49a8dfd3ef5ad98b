"""``polychip pack``: write the weights (quantised when asked) as safetensors shards and copy the
config and tokenizer into a staging folder, load that folder on the target device to record the
plan, hash every file while streaming, write and sign the manifest, and put it all in one tar."""
from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass, field

from safetensors import safe_open
from safetensors.torch import save_file

from polychip.devices.discovery import open_device
from polychip.config import QUANTIZATIONS
from polychip.models.loader import read_config, resolve_model_dir, stored_meta, weight_files
from polychip.trust import keys as signing
from polychip.package.compat import current_versions
from polychip.package.hashing import sha256_file
from polychip.package.manifest import (FORMAT_VERSION, MANIFEST, PLAN, SIGNATURE, SUFFIX, PackageError,
                                       dump_manifest, manifest_sha256, name_problem)
from polychip.package.op_plan import build_op_plan, dump_op_plan
from polychip.quant import int8
from polychip.quant.self_quant import SELF_SCHEMES, w8a8_config, w8a8_entries
from polychip.trust.pins import pin_of

log = logging.getLogger("polychip.package")

# what a model folder contributes besides its weights: config, tokenizer and chat template
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
               "vocab.json", "merges.txt")
SHARD_BYTES = 2 * 2**30
#: what pack quantises a float model into: int8 (weight-only) or w8a8 (compressed-tensors' layout)
PACK_QUANTIZATIONS = ("int8", *SELF_SCHEMES)


@dataclass(frozen=True)
class PackOptions:
    output: str
    model_path: str | None = None           # None: the embedded SmolLM2 GGUF
    quantization: str | None = None
    target_device: str = "cpu"
    device_config: str | None = None
    plugins: tuple[str, ...] = ()
    sign_key: str | None = None
    dtype: str = "auto"
    cache_dir: str | None = None
    shard_bytes: int = SHARD_BYTES
    release: int | None = None              # the model's release number (the trust store refuses older ones)
    release_name: str | None = None         # the model's name for release numbers (default: the output's stem)

    def __post_init__(self):
        if self.release is not None and self.release < 0:
            raise PackageError(f"--release must be >= 0, got {self.release}")
        if not self.output.endswith(SUFFIX):
            raise PackageError(f"-o {self.output}: a package file must end in {SUFFIX}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise PackageError(f"--quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}")


@dataclass
class PackResult:
    path: str
    manifest_sha256: str
    signed_by: str | None
    files: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def write_weights(model_dir: str, out: str, tie: bool, quantization: str | None, shard_bytes: int) -> list[str]:
    """The folder's weights as safetensors shards in ``out``: as stored, or quantised: int8 (+ per-row
    scales for every linear weight; a tied model gets an int8 lm_head made from its embedding) or
    w8a8 (every linear weight and the embedding int8 + [N, 1] scales, compressed-tensors' layout).
    One shard in memory at a time. Returns the file names written."""
    shards, current, size = [], {}, 0

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, os.path.join(out, name), metadata={"format": "pt"})
            shards.append((name, list(current)))
            current, size = {}, 0

    for path in weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                key = name.removeprefix("model.")
                if key == int8.LM_HEAD_KEY and tie and f"{name}{int8.SCALE_SUFFIX}" not in f.keys():
                    continue                  # a tied head is the embedding (int8: a copy is made below)
                t = f.get_tensor(name)
                entries = [(name, t)]
                if quantization == "w8a8":
                    entries = w8a8_entries(name, t)
                elif quantization and int8.is_quantizable(key, t):
                    q, scale = int8.quantize_int8(t)
                    entries = [(name, q), (int8.scale_key(name), scale)]
                if quantization == "int8" and tie and key == int8.EMBEDDING_KEY:
                    entries += int8.quantized_entries(int8.LM_HEAD_KEY, t)
                for k, v in entries:
                    current[k] = v.contiguous()
                    size += v.numel() * v.element_size()
                if size >= shard_bytes:
                    flush()
    flush()
    if len(shards) == 1:
        os.replace(os.path.join(out, shards[0][0]), os.path.join(out, "model.safetensors"))
        return ["model.safetensors"]
    index = {"metadata": {}, "weight_map": {k: name for name, keys in shards for k in keys}}
    with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return [name for name, _ in shards] + ["model.safetensors.index.json"]


def pack_quantization(model_dir: str, quantization: str | None) -> str | None:
    """How pack writes the weights: a checkpoint quantised elsewhere (``quantization_config``) or an
    int8 package as they are (``--quantization`` may only name their scheme, which loading checks);
    a float model quantised as asked."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        stored = "quantization_config" in json.load(f)
    if not stored:
        stored = int8.is_int8_state(stored_meta(weight_files(model_dir)))
    if not stored and quantization not in (None, *PACK_QUANTIZATIONS):
        raise PackageError(f"--quantization {quantization}: {model_dir} is a float model, and pack quantises one "
                           f"only into {list(PACK_QUANTIZATIONS)}; {quantization} needs a checkpoint quantised with it")
    return None if stored else quantization


def add_quantization_config(staging: str, qc: dict) -> None:
    path = os.path.join(staging, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


def copy_model_files(model_dir: str, out: str) -> list[str]:
    names = [n for n in MODEL_FILES if os.path.isfile(os.path.join(model_dir, n))]
    for n in names:
        shutil.copyfile(os.path.join(model_dir, n), os.path.join(out, n))
    return names


def write_tar(staging: str, names: list[str], output: str, mtime: int) -> None:
    """The members in this order, as plain 0644 files owned by root; written beside ``output``
    and renamed into place, so a half-written package never has the name."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(output)}.", dir=os.path.dirname(os.path.abspath(output)))
    os.close(fd)
    try:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            for name in names:
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = os.path.getsize(os.path.join(staging, name)), 0o644, mtime
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                with open(os.path.join(staging, name), "rb") as f:
                    tar.addfile(info, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, output)
    except BaseException:
        os.unlink(tmp)
        raise


def source_name(model_path: str | None) -> str:
    if model_path is None:
        from polychip.models.gguf import default_gguf_path
        return os.path.basename(default_gguf_path())
    return os.path.basename(os.path.normpath(model_path))


def assemble(staging: str, names: list[str], output: str, fields: dict, private=None) -> bytes:
    """Hash the files ``names`` in ``staging`` (streaming), write manifest.json (``fields`` plus
    the format version, creation time and the file list) and, with ``private``, manifest.sig, then
    the tar at ``output``. Returns the manifest's bytes."""
    bad = [(n, name_problem(n)) for n in names if name_problem(n)]
    if bad:
        raise PackageError(f"cannot pack {bad[0][0]!r}: it is {bad[0][1]}")
    files = []
    for n in names:
        digest, size = sha256_file(os.path.join(staging, n))
        files.append({"name": n, "sha256": digest, "size": size})
    created = time.time()
    manifest = {"format_version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                **fields, "files": files}
    raw = dump_manifest(manifest)
    with open(os.path.join(staging, MANIFEST), "wb") as f:
        f.write(raw)
    order = [MANIFEST]
    if private is not None:
        with open(os.path.join(staging, SIGNATURE), "wb") as f:
            f.write(signing.sign(raw, private))
        order.append(SIGNATURE)
    write_tar(staging, order + names, output, int(created))
    return raw


def release_field(opts: PackOptions) -> dict:
    if opts.release is None:
        return {}
    name = opts.release_name or os.path.basename(opts.output).removesuffix(SUFFIX)
    return {"release": {"name": name, "number": opts.release}}


def pack(opts: PackOptions) -> PackResult:
    """Write the package. The plan is made by loading the staged files themselves on the target,
    so it describes exactly what is packed (and an int8 model is quantised once)."""
    t0 = time.perf_counter()
    private = signing.load_private_key(opts.sign_key) if opts.sign_key else None   # fail before the work
    model_dir, _ = resolve_model_dir(opts.model_path, opts.cache_dir)
    cfg = read_config(model_dir)
    plugin = open_device(opts.target_device, opts.plugins, opts.device_config)
    staging = tempfile.mkdtemp(prefix=".pcpkg-staging-", dir=os.path.dirname(os.path.abspath(opts.output)))
    try:
        try:
            names = copy_model_files(model_dir, staging)
            quantize = pack_quantization(model_dir, opts.quantization)
            names += write_weights(model_dir, staging, cfg.tie_word_embeddings, quantize, opts.shard_bytes)
            if quantize == "w8a8":
                add_quantization_config(staging, w8a8_config())
            plan, lm = build_op_plan(staging, plugin, opts.dtype, quantization=opts.quantization)
            versions = current_versions(plugin)
            pin = pin_of(plugin)
            del lm
        finally:
            plugin.destroy()
        with open(os.path.join(staging, PLAN), "wb") as f:
            f.write(dump_op_plan(plan))
        raw = assemble(staging, [PLAN] + names, opts.output, {
            "model": {"source": source_name(opts.model_path), "architecture": cfg.architecture,
                      "dtype": plan["dtype"], "quantization": plan["quantization"],
                      "quantization_format": plan["quantization_format"]},
            "target": {"device_types": [plan["target"]["device_type"]], "device_name": plan["target"]["device_name"],
                       "spec": plan["target"]["spec"]},
            "versions": versions, "plugin_pin": pin, **release_field(opts)}, private)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    signer = signing.key_id(private.public_key()) if private is not None else None
    files = json.loads(raw)["files"]
    result = PackResult(opts.output, manifest_sha256(raw), signer, files, time.perf_counter() - t0)
    log.info("packed %s (%d files, manifest %s) in %.1fs", opts.output, len(files), result.manifest_sha256[:16],
             result.seconds)
    return result
