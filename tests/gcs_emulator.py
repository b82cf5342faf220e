"""A local Google Cloud Storage API (gcp-storage-emulator, in memory, on 127.0.0.1) for tests of gs:// paths.

The clients are pointed at it through their documented endpoint settings: TensorStore (orbax's array
storage) by TENSORSTORE_GCS_HTTP_URL, gcsfs (etils.epath's gs:// backend) and google-cloud-storage
(tensorboardX) by STORAGE_EMULATOR_HOST. Anonymous credentials, and the metadata-server probes that
google-auth and TensorStore make pointed at a closed local port, so nothing leaves loopback.
"""
import os
import signal
import socket
import subprocess
import sys
import time

BUCKET = "glm5-test"

# The emulator's media download omits the x-goog-generation header that GCS sends and TensorStore's
# OCDBT driver (orbax's array format) reads; this launcher adds it before starting the emulator.
LAUNCHER = """
import sys
from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    except Exception:
        pass


objects.download = download
from gcp_storage_emulator.__main__ import main

sys.argv = ["gcp-storage-emulator"] + sys.argv[1:]
sys.exit(main())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_env(url: str) -> dict:
    closed = f"127.0.0.1:{_free_port()}"          # nothing listens there: metadata probes fail at once
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "FSSPEC_GCS_TOKEN": "anon",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",        # the emulator speaks JSON only, no gRPC
            "NO_GCE_CHECK": "true", "GCE_METADATA_HOST": closed, "GCE_METADATA_ROOT": closed,
            "GCE_METADATA_IP": closed, "GOOGLE_CLOUD_PROJECT": "test"}


class Emulator:
    def __init__(self):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, "start", "--host", "127.0.0.1", f"--port={self.port}", "--in-memory",
                                      f"--default-bucket={BUCKET}", "--quiet"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError("gcp-storage-emulator did not start")
                time.sleep(0.05)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
