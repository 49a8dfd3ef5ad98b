"""Prefill on one chip, decode on another: the KV hand-off between two engines (docs/disaggregation.md).

kv_format   the canonical KV format at the boundary: identities, pool formats, chunk headers, conversion
pages       token ranges of a request's pages staged through the plugin (device -> host, host -> device)
wire        framed, validated messages on a socket
ring        space in a host buffer, handed out in order
transports  how a chunk's bytes travel: tcp (several connections), local (shared memory); backends sets
            them up, mooncake_backend is Mooncake's transfer engine
agent       what both sides share: settings, supervised threads, links, figures
prefill     the prefill side: the bootstrap listener, one Outbound per request, pages held until the ack
decode      the decode side: reservation, one Inbound per request, fallback to plain serving
handoff     what an engine in either role adds to its step
"""
