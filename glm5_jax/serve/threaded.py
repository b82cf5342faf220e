"""Run an ASGI app (the API or the router) with uvicorn in a background thread, e.g. inside an RL process."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn


class ThreadedServer:
    """Serves `app` on ``host`` at a free port (``.url``) until `close()`."""

    def __init__(self, app, host: str = "127.0.0.1", start_timeout_s: float = 30.0):
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
