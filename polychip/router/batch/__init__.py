"""OpenAI batch jobs: the JSONL input lines (parsed and checked against the endpoints' request
models, with line numbers), the output records, the ordered streaming writer with its resume set,
and the bounded runner that both ``polychip batch`` (engine in-process) and the router's
``/v1/batches`` (the router's own dispatch) drive with their own ``send``."""
