"""Server mode: one shared L1 per node in memfd segments, driven over a SOCK_SEQPACKET Unix socket.

``protocol`` (wire format), ``segment`` (memfd slots + header table), ``slots`` (slot states, leases,
eviction), ``server`` (asyncio control plane), ``client`` (the L1 surface on a shared segment).
"""
