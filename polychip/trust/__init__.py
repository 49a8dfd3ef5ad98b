"""The site's trust chain beyond a package's own signature: the trust store (keys with ids,
expiry and revocation, the releases seen), detached signatures of YAML files, plugins pinned by
the package, the syscall filter of a serving process. A library: no CLI imports."""
