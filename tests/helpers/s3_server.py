"""A real S3 API on localhost for the object-storage tests: moto's server (moto[server]) in this process, on a free
port, with one bucket; kiln's processes reach it through the standard environment.

    with S3Server() as s3:                       # or the `s3` fixture (tests/conftest.py)
        run_kiln(args, env=s3.env)               # AWS_ENDPOINT_URL and test credentials for kiln's processes
        s3.keys("run/checkpoint")                # what the bucket holds there: ["step-2/.metadata", ...]
"""

from __future__ import annotations

import urllib.request
from typing import Any

from tests.helpers.common import free_port

BUCKET = "kiln-test"


class BucketServer:
    """What a test asks of a bucket on a local server, whichever store (S3Server, GCSServer): its `fs` (an fsspec
    filesystem on the server), `scheme`, `env` and `_server` (stopped at the end) are the subclass's."""

    scheme: str
    fs: Any
    env: dict[str, str]  # what kiln's processes need to reach the server
    _server: Any

    def url(self, prefix: str) -> str:
        return f"{self.scheme}://{BUCKET}/{prefix}"

    def keys(self, prefix: str) -> list[str]:
        """Every key under `prefix` in the bucket, relative to it, sorted."""
        root = f"{BUCKET}/{prefix}"
        return sorted(k[len(root) + 1 :] for k in self.fs.find(root))

    def read(self, key: str) -> bytes:
        return self.fs.cat_file(f"{BUCKET}/{key}")

    def write(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(f"{BUCKET}/{key}", data)

    def remove(self, key: str) -> None:
        self.fs.rm_file(f"{BUCKET}/{key}")

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> BucketServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class S3Server(BucketServer):
    """moto's ThreadedMotoServer on 127.0.0.1:<free port> with bucket BUCKET; `env` points kiln at it."""

    scheme = "s3"

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        # moto keeps its buckets per process, not per server: start from none (moto's own reset endpoint)
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")).close()
        self.fs = self.client()
        self.fs.mkdir(BUCKET)

    def client(self) -> Any:
        """An s3fs filesystem on the server, as the test's own (no caches: it reads what kiln just wrote)."""
        import s3fs

        return s3fs.S3FileSystem(
            key="testing",
            secret="testing",
            endpoint_url=self.endpoint,
            skip_instance_cache=True,
            use_listings_cache=False,
        )
