"""Read a package in one streaming pass over its tar: the manifest first, then its signature,
then every member hashed in 1 MiB chunks while (optionally) being written to a folder.

Each check is recorded as a :class:`Check`; the first failure raises a :class:`PackageError`
naming the file and the reason, unless ``keep_going`` (``polychip verify`` reports them all).
Members are never extracted by tarfile: only regular files with plain data-file names listed in
the manifest are read, and written by this module with O_EXCL | O_NOFOLLOW.
"""
from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass, field

from polychip.trust import keys as signing
from polychip.package.hashing import copy_hashing
from polychip.package.manifest import (MANIFEST, MAX_MANIFEST_BYTES, MAX_SIGNATURE_BYTES, PLAN, SIGNATURE,
                                       PackageError, manifest_sha256, name_problem, parse_manifest)

END_OF_ARCHIVE = 2 * tarfile.BLOCKSIZE


@dataclass
class Check:
    status: str          # "ok", "warn", "skip" or "FAIL"
    what: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.what}: {self.detail}"


@dataclass
class ScanResult:
    path: str
    manifest: dict | None = None
    manifest_raw: bytes = b""
    manifest_sha256: str = ""
    signer: signing.TrustedKey | None = None
    signature_key_id: str | None = None
    plan_raw: bytes | None = None
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)


def type_problem(m: tarfile.TarInfo) -> str:
    """Why a tar member is not a plain regular file ("" when it is)."""
    if m.issym():
        return f"a symbolic link (to {m.linkname!r}); refused"
    if m.islnk():
        return f"a hard link (to {m.linkname!r}); refused"
    if m.ischr() or m.isblk():
        return "a device file; refused"
    if m.isfifo():
        return "a FIFO; refused"
    if m.isdir():
        return "a directory; packages hold plain files only"
    if not m.isreg():
        return f"not a regular file (tar type {m.type!r}); refused"
    return ""


def member_problem(m: tarfile.TarInfo) -> str:
    """Why a tar member is unsafe to read ("" when it is a regular file with a plain name)."""
    return name_problem(m.name) or type_problem(m)


class _Scan:
    def __init__(self, path: str, trusted: list[signing.TrustedKey], require_signature: bool,
                 keep_going: bool, out_dir: str | None, allow_unsigned: bool = False):
        self.res = ScanResult(path)
        self.allow_unsigned = allow_unsigned   # a trust store's keys are given, and --allow-unsigned
        self.until: str | None = None          # stop after this member (inspect reads up to plan.json)
        self.refused = 0                       # members refused (unsafe, unlisted, repeated)
        self.trusted, self.require, self.keep_going, self.out_dir = trusted, require_signature, keep_going, out_dir

    def check(self, status: str, what: str, detail: str) -> None:
        self.res.checks.append(Check(status, what, detail))
        if status == "FAIL" and not self.keep_going:
            raise PackageError(f"{self.res.path}: {what}: {detail}")

    def fatal(self, what: str, detail: str):
        """A failure after which the stream cannot be read on."""
        self.res.checks.append(Check("FAIL", what, detail))
        raise PackageError(f"{self.res.path}: {what}: {detail}")

    def read_small(self, tar: tarfile.TarFile, m: tarfile.TarInfo, limit: int) -> bytes:
        if m.size > limit:
            self.fatal(m.name, f"{m.size} bytes; at most {limit} are accepted")
        data = tar.extractfile(m).read()
        if len(data) != m.size:
            self.fatal("archive", f"truncated tar: {m.name} ends after {len(data)} of {m.size} bytes")
        return data

    def head(self, tar: tarfile.TarFile, members) -> tarfile.TarInfo | None:
        """Read manifest.json (the first member) and manifest.sig; check the signature. Returns the
        member after them."""
        first = next(members, None)
        if first is None:
            self.fatal("archive", "an empty tar; expected manifest.json first")
        if first.name != MANIFEST:
            self.fatal(first.name, f"the first member must be {MANIFEST}")
        if type_problem(first):
            self.fatal(MANIFEST, type_problem(first))
        raw = self.read_small(tar, first, MAX_MANIFEST_BYTES)
        self.res.manifest = parse_manifest(raw, self.res.path)
        self.res.manifest_raw, self.res.manifest_sha256 = raw, manifest_sha256(raw)
        self.check("ok", "manifest", f"format version {self.res.manifest['format_version']}, "
                   f"{len(self.res.manifest['files'])} files, sha256 {self.res.manifest_sha256[:16]}")
        nxt = next(members, None)
        sig = None
        if nxt is not None and nxt.name == SIGNATURE:
            if type_problem(nxt):
                self.fatal(SIGNATURE, type_problem(nxt))
            sig = self.read_small(tar, nxt, MAX_SIGNATURE_BYTES)
            nxt = next(members, None)
        self.signature(raw, sig)
        return nxt

    def signature(self, manifest: bytes, sig: bytes | None) -> None:
        if sig is not None:
            try:
                self.res.signature_key_id = signing.signature_key_id(sig)[0]
            except signing.TrustError as e:
                self.fatal(SIGNATURE, e.args[0])
        if not self.trusted and not self.require:
            self.check("skip", "signature", "unsigned package" if sig is None else
                       f"signed by key {self.res.signature_key_id[:16]}; not checked (no --trusted-key)")
            return
        if sig is None and self.allow_unsigned:
            self.check("warn", "signature", f"UNSIGNED (no {SIGNATURE}); accepted by --allow-unsigned")
            return
        if sig is None:
            self.fatal("signature", f"no {SIGNATURE}: the package is unsigned and a signature is required")
        if not self.trusted:
            self.fatal("signature", "a signature is required but no --trusted-key was given to check it with")
        try:
            self.res.signer = signing.verify(manifest, sig, self.trusted)
        except signing.TrustError as e:
            self.fatal("signature", e.args[0])
        self.check("ok", "signature", f"{signing.ALGORITHM} by trusted key {self.res.signer.label()}")

    def body(self, tar: tarfile.TarFile, m: tarfile.TarInfo | None, members) -> None:
        listed = {f["name"]: f for f in self.res.manifest["files"]}
        seen = set()
        while m is not None:
            self.member(tar, m, listed, seen)
            if m.name == self.until:
                return
            m = next(members, None)
        missing = sorted(set(listed) - seen)
        for name in missing:
            self.check("FAIL", name, "missing: listed in the manifest but not in the package")
        if not missing and not self.refused:
            self.check("ok", "files", f"all {len(listed)} listed files present, no extra member")

    def member(self, tar, m, listed: dict, seen: set) -> None:
        why = member_problem(m)
        if not why and m.name in (MANIFEST, SIGNATURE):
            why = f"a second {m.name}; it must come once, at the start"
        elif not why and m.name not in listed:
            why = "extra file: not listed in the manifest"
        elif not why and m.name in seen:
            why = "appears twice in the archive"
        if why:
            self.refused += 1
            return self.check("FAIL", m.name, why)
        entry = listed[m.name]
        seen.add(m.name)
        if m.size != entry["size"]:
            return self.check("FAIL", m.name, f"size mismatch: {m.size} bytes, the manifest says {entry['size']}")
        if m.name == PLAN:      # small JSON the caller parses: kept, and hashed from memory
            data = self.read_small(tar, m, MAX_MANIFEST_BYTES)
            digest, n = manifest_sha256(data), len(data)
            self.res.plan_raw = data
            if self.out_dir is not None:
                with self.create(m.name) as dst:
                    dst.write(data)
        elif self.out_dir is None:
            digest, n = copy_hashing(tar.extractfile(m), None, limit=m.size)
        else:
            with self.create(m.name) as dst:
                digest, n = copy_hashing(tar.extractfile(m), dst, limit=m.size)
        if n != m.size:
            self.fatal("archive", f"truncated tar: {m.name} ends after {n} of {m.size} bytes")
        if digest != entry["sha256"]:
            return self.check("FAIL", m.name, f"hash mismatch: sha256 {digest[:16]}..., the manifest says "
                                              f"{entry['sha256'][:16]}...")
        self.check("ok", m.name, f"sha256 {digest[:16]}..., {n} bytes")

    def create(self, name: str):
        """A new file in the extraction folder (never through an existing name or a link)."""
        fd = os.open(os.path.join(self.out_dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        return os.fdopen(fd, "wb")


def scan(path: str, trusted: list[signing.TrustedKey] = (), require_signature: bool = False,
         keep_going: bool = False, out_dir: str | None = None, head_only: bool = False,
         until: str | None = None, allow_unsigned: bool = False) -> ScanResult:
    """Verify the package at ``path`` in one pass; with ``out_dir``, write its members there.
    ``head_only``: stop after the manifest and signature; ``until``: after that member."""
    s = _Scan(path, list(trusted), require_signature, keep_going, out_dir, allow_unsigned)
    s.until = until
    try:
        f = open(path, "rb")
    except OSError as e:
        raise PackageError(f"{path}: cannot open the package: {e.strerror}") from None
    with f:
        try:
            with tarfile.open(fileobj=f, mode="r|") as tar:
                members = iter(tar)
                after_head = s.head(tar, members)
                if head_only:
                    return s.res
                s.body(tar, after_head, members)
                if until is not None:
                    return s.res
                end = tar.offset
            if os.fstat(f.fileno()).st_size < end + END_OF_ARCHIVE:
                s.fatal("archive", f"truncated tar: it stops at byte {os.fstat(f.fileno()).st_size} without its "
                                   "end-of-archive blocks")
        except PackageError as e:
            if not keep_going:
                raise
            if not s.res.checks or s.res.checks[-1].status != "FAIL":
                s.res.checks.append(Check("FAIL", "package", str(e).removeprefix("[framework] ")))
            return s.res
        except (tarfile.TarError, EOFError) as e:
            detail = str(e) or type(e).__name__
            truncated = "unexpected end" in detail or isinstance(e, EOFError) or "truncated" in detail
            s.res.checks.append(Check("FAIL", "archive", f"truncated tar ({detail})" if truncated
                                      else f"not a readable tar archive ({detail})"))
            if not keep_going:
                raise PackageError(f"{path}: archive: {s.res.checks[-1].detail}") from None
    return s.res
