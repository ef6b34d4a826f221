"""An app served from a thread of this process, for the tests and in-process measurements:
`with BackgroundServer(app) as url: ...` (`mini serve` runs the same app in the foreground); `wait_idle(engine)`
before asserting that a burst left nothing behind."""
from __future__ import annotations

import threading
import time

from mini.parallel.launch import free_port
from mini.server.guard import Policy, h11_with_header_timeout


class BackgroundServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn
        port = port or free_port(host)
        self.url = f"http://{host}:{port}"
        policy = getattr(app.state, "policy", None) or Policy()
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    http=h11_with_header_timeout(policy.read_timeout_s)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def wait_idle(engine, seconds: float = 300.0) -> bool:
    """Poll until the engine holds no request and runs no sequence: the abort of a request whose client went away
    reaches the engine at its next step, after the client has already moved on. The deadline only stops a hung
    test; a busy machine never gets near it. Returns whether it became idle."""
    deadline = time.monotonic() + seconds
    while engine.requests or engine.scheduler.running:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
