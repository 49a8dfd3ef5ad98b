"""polychip's version: a leaf, so the package facade and what records the version import no cycle."""
__version__ = "0.1.0"
