"""The flags of ``polychip serve`` (SGLang's names), shared by ``serve`` and ``serve --dp-size``
(``serve_dp``), so neither command imports the other. They come from the serve settings
(``polychip/http/serve_settings.py``), the same that check a workload's serve_args."""
from __future__ import annotations

from polychip.http.serve_settings import serve_parser


def build_parser():
    return serve_parser("polychip serve", "polychip serve: the OpenAI-compatible HTTP server (SGLang's flag names)")
