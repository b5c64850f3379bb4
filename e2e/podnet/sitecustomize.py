"""A pod's network namespace, emulated for one process: the kubelet stand-in (e2e/kubelet.py)
puts this directory on PYTHONPATH and the pod's loopback address in PDSERVE_KUBELET_POD_IP.

In a real pod, binding 0.0.0.0 means "every interface of this pod", i.e. the pod IP (and the
pod's own loopback): two pods may both listen on :8000. Here every pod shares the host, so a
wildcard bind is narrowed to the pod's own 127.0.0.x address, keeping the container's command
line exactly as the operator wrote it. Python sockets (asyncio, uvloop, aiohttp) and ZeroMQ
binds are covered; anything binding through its own C code is not (nothing pdserve runs does).
"""

import os

_POD_IP = os.environ.get("PDSERVE_KUBELET_POD_IP")

if _POD_IP:
    import socket

    _bind = socket.socket.bind

    def _pod_bind(self, address):
        if isinstance(address, tuple) and address and address[0] in ("", "0.0.0.0") and self.family == socket.AF_INET:
            address = (_POD_IP, *address[1:])
        return _bind(self, address)

    socket.socket.bind = _pod_bind

    try:
        import zmq
    except ImportError:
        zmq = None
    if zmq is not None:
        _zbind = zmq.Socket.bind

        def _pod_zbind(self, addr):
            for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
                if isinstance(addr, str) and addr.startswith(wildcard):
                    addr = f"tcp://{_POD_IP}:" + addr[len(wildcard):]
            return _zbind(self, addr)

        zmq.Socket.bind = _pod_zbind
