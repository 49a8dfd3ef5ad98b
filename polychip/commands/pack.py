"""polychip pack --model-path M [--quantization int8|w8a8] [--target-device TYPE] [--device-config SPEC]
[--sign-key KEY] -o model.pcpkg: one signed file with the weights, config, tokenizer, the plan the
engine chooses on the target device, and the manifest of hashes and versions."""
from __future__ import annotations

import resource
import sys

from polychip.commands.common import fail, setup_logging
from polychip.config import QUANTIZATIONS
from polychip.dtypes import MODEL_DTYPES
from polychip.errors import PolychipError
from polychip.flags import Parser


def build_parser() -> Parser:
    p = Parser(prog="polychip pack", description=__doc__)
    p.add_argument("--model-path", default=None, help="HF folder or .gguf file (default: embedded SmolLM2)")
    p.add_argument("-o", "--output", required=True, help="the package file to write (.pcpkg)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="a float model: int8 (weight-only) or w8a8 (compressed-tensors W8A8, round to nearest, "
                        "dynamic per-token activations); a checkpoint quantised elsewhere is packed as stored "
                        "and this may only name its scheme")
    p.add_argument("--target-device", "--device", dest="target_device", default="cpu",
                   help="the device type (plugin) the plan is made for, e.g. simxpu (--device: as serve spells it)")
    p.add_argument("--device-config", default=None, help="device spec YAML of the target")
    p.add_argument("--plugin", action="append", default=[], dest="plugins",
                   help="extra device plugin: module.path or path/to/plugin.py (repeatable)")
    p.add_argument("--sign-key", default=None, help="Ed25519 private key (polychip keygen) to sign the manifest")
    p.add_argument("--release", type=int, default=None,
                   help="release number of this model (a site's trust store refuses a lower one than it has loaded)")
    p.add_argument("--release-name", default=None, help="the model name release numbers count for (default: "
                                                         "the output file's name without .pcpkg)")
    p.add_argument("--dtype", default="auto", choices=MODEL_DTYPES)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    from polychip.package.pack import PackOptions, pack
    try:
        res = pack(PackOptions(args.output, args.model_path, args.quantization, args.target_device,
                               args.device_config, tuple(args.plugins), args.sign_key, args.dtype, args.cache_dir,
                               release=args.release, release_name=args.release_name))
    except PolychipError as e:
        return fail(e)
    total = sum(f["size"] for f in res.files)
    print(f"wrote {res.path}: {len(res.files)} files, {total} bytes, manifest sha256 {res.manifest_sha256}")
    print("signed by key " + res.signed_by[:16] if res.signed_by else "unsigned (no --sign-key)")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"[packed in {res.seconds:.1f}s, peak resident memory {peak / 1024:.0f} MiB]", file=sys.stderr)
    return 0
