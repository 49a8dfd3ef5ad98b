"""Routing a request: which workers may take it (dispatch), which one does (policies, prefix tree),
who waits first (wfq), and the attempts on it (proxy: retries, the SSE relay, outcomes; pd: prefill
and decode pairs)."""
