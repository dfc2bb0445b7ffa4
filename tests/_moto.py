"""A real S3 API for the tests: moto's server (`python -m moto.server`) on a free 127.0.0.1 port, as a subprocess.

pyarrow, boto3 and Ray Train find it through the standard environment: AWS_ENDPOINT_URL (the AWS SDKs' custom
endpoint variable, which pyarrow 25's S3FileSystem honours), dummy credentials, and no EC2 metadata lookups.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid

from _cluster import stop_process_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoS3:
    def __init__(self, log_path: str):
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}; see {log_path}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                break
            except OSError:
                if time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not listen within 60 s; see {log_path}") from None
                time.sleep(0.2)
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def bucket(self) -> str:
        """A new empty bucket."""
        name = f"rayspeed-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        out, token = [], None
        c = self.client()
        while True:
            kw = {"Bucket": bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            r = c.list_objects_v2(**kw)
            out += [o["Key"] for o in r.get("Contents", [])]
            if not r.get("IsTruncated"):
                return sorted(out)
            token = r["NextContinuationToken"]

    def stop(self) -> None:
        stop_process_group(self.proc, 20)
        self.log.close()
