"""``polychip batch``'s own parts (the engine in-process, the progress bar); the batch file's
lines, records, writer and runner are shared with the router's /v1/batches in
``polychip/router/batch/``, and the server checks the bodies (``server/batch_check.py``)."""
