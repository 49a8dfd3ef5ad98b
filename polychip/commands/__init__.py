"""One module per CLI command, each with ``main(argv) -> int``."""
