"""Blobs in an S3-compatible object store, for the Batch API's files (`gateway.files_url: s3://bucket/prefix/`).

The endpoint and credentials come from the environment, as the embedded broker's Tansu reads them
(consumers/broker/object_store.py `broker_env`): AWS_ENDPOINT (else AWS's own for AWS_DEFAULT_REGION),
AWS_ALLOW_HTTP=true for a plain-HTTP endpoint, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY. So a
gateway given the broker's environment keeps its files in the store that holds the broker's records.
Requests are path-style and signed with AWS Signature Version 4 when a key is set.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
from collections.abc import Mapping
from urllib.parse import quote, urlsplit

import httpx

TIMEOUT_S = 30.0


class BlobStoreError(OSError):
    pass


class S3Blobs:
    def __init__(self, url: str, env: Mapping[str, str] = os.environ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"gateway.files_url: expected s3://bucket/prefix, got {url!r}")
        self.bucket, self.prefix = parts.netloc, parts.path.strip("/")
        self.region = env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION") or "us-east-1"
        self.endpoint = (env.get("AWS_ENDPOINT") or env.get("AWS_ENDPOINT_URL")
                         or f"https://s3.{self.region}.amazonaws.com").rstrip("/")
        if self.endpoint.startswith("http://") and env.get("AWS_ALLOW_HTTP", "").lower() != "true":
            raise ValueError(f"gateway.files_url: the endpoint {self.endpoint} is plain HTTP; set AWS_ALLOW_HTTP=true "
                             f"to allow it")
        self.key_id, self.secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")

    async def put(self, name: str, data: bytes) -> None:
        response = await self._request("PUT", name, data)
        if response.status_code not in (200, 201, 204):
            raise BlobStoreError(f"PUT {name}: the object store answered {response.status_code}")

    async def get(self, name: str) -> bytes | None:
        """The blob's bytes; None when there is none."""
        response = await self._request("GET", name, b"")
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise BlobStoreError(f"GET {name}: the object store answered {response.status_code}")
        return response.content

    async def _request(self, method: str, name: str, body: bytes) -> httpx.Response:
        path = "/" + quote(f"{self.bucket}/{self.prefix}/{name}" if self.prefix else f"{self.bucket}/{name}")
        headers = sign_v4(method, self.endpoint, path, body, key_id=self.key_id, secret=self.secret,
                          region=self.region, now=datetime.datetime.now(datetime.timezone.utc))
        try:
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
                return await client.request(method, self.endpoint + path, content=body, headers=headers)
        except httpx.HTTPError as error:
            raise BlobStoreError(f"{method} {name}: {type(error).__name__}: {error}") from None


def sign_v4(method: str, endpoint: str, path: str, body: bytes, *, key_id: str | None, secret: str | None,
            region: str, now: datetime.datetime, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The headers of an S3 request signed with AWS Signature Version 4 (none to sign without a key)."""
    host = urlsplit(endpoint).netloc
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    payload = hashlib.sha256(body).hexdigest()
    headers = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": stamp,
               **{k.lower(): v for k, v in (extra or {}).items()}}
    if not key_id or not secret:
        return headers
    names = sorted(headers)
    canonical = "\n".join([method, path, "", *(f"{n}:{headers[n].strip()}" for n in names), "",
                           ";".join(names), payload])
    scope = f"{stamp[:8]}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = f"AWS4{secret}".encode()
    for part in (stamp[:8], region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={key_id}/{scope}, SignedHeaders={';'.join(names)}, "
                                f"Signature={signature}")
    return headers
