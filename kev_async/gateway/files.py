"""The Batch API's files: an uploaded batch input, and the output and error files a batch writes.

Each file is two blobs: its bytes, and its metadata (`<id>.json`: OpenAI's file object plus the
tenant that owns it), written in that order, so a file exists once its metadata does. The blobs live
in an S3-compatible object store (`gateway.files_url`, s3_blobs.py: the store the durable broker
uses, or any other) or else in a directory (`gateway.files_dir`, default `files` under Kev's cache
directory), where each is written to a temporary name and renamed, so a reader never sees half a
file and a gateway killed mid-write leaves none. A file is visible only to its own tenant (anonymous callers
share one scope, as they share kept answers); anyone else gets the 404 an unknown id gets, so ids
cannot be probed. Ids carry 128 random bits; output files get an id derived from their batch's, so a
batch finalized again after a restart rewrites the same file instead of leaving a second one.
"""

from __future__ import annotations

import email.parser
import email.policy
import hashlib
import os
import re
import secrets
import time
from pathlib import Path

import anyio
import msgspec
import platformdirs

from kev_async.gateway.errors import ApiError, bad_request
from kev_async.gateway.s3_blobs import S3Blobs
from schemas import GatewayConfig

_FILE_ID = re.compile(r"file-[0-9a-f]{32}")


class StoredFile(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str  # batch (an upload) | batch_output
    tenant: str | None = None

    def openai(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None, "expires_at": None}


_STORED = msgspec.json.Decoder(StoredFile)


def default_files_dir() -> Path:
    configured = os.environ.get("KEV_CACHE_DIR")
    return Path(configured) / "files" if configured else Path(platformdirs.user_cache_dir("kev")) / "files"


def new_file_id() -> str:
    return f"file-{secrets.token_hex(16)}"


def derived_file_id(batch_id: str, role: str) -> str:
    """The id of a batch's output or error file: the same whenever that batch is finalized."""
    return "file-" + hashlib.sha256(f"{batch_id}/{role}".encode()).hexdigest()[:32]


class LocalBlobs:
    """Blobs as files in a directory."""

    def __init__(self, root: str | os.PathLike | None) -> None:
        self.root = Path(root).expanduser() if root else default_files_dir()

    async def put(self, name: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(self._write, name, data)

    async def get(self, name: str) -> bytes | None:
        try:
            return await anyio.Path(self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def _write(self, name: str, data: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / name
        partial = path.with_name(f".{name}.{secrets.token_hex(4)}")
        partial.write_bytes(data)
        partial.replace(path)


def blobs_for(cfg: GatewayConfig) -> LocalBlobs | S3Blobs:
    return S3Blobs(cfg.files_url) if cfg.files_url else LocalBlobs(cfg.files_dir)


class FileStore:
    def __init__(self, blobs: LocalBlobs | S3Blobs) -> None:
        self.blobs = blobs

    async def save(self, content: bytes, *, filename: str, purpose: str, tenant: str | None,
                   file_id: str | None = None) -> StoredFile:
        stored = StoredFile(id=file_id or new_file_id(), bytes=len(content), created_at=int(time.time()),
                            filename=filename, purpose=purpose, tenant=tenant)
        try:
            await self.blobs.put(stored.id, content)
            await self.blobs.put(f"{stored.id}.json", msgspec.json.encode(stored))  # last: now the file exists
        except OSError as error:
            raise _unavailable(error) from None
        return stored

    async def get(self, file_id: str, tenant: str | None) -> StoredFile:
        """The file's object; 404 when unknown or another tenant's."""
        meta = await self._get(f"{file_id}.json") if _FILE_ID.fullmatch(file_id) else None
        stored = _STORED.decode(meta) if meta is not None else None
        if stored is None or stored.tenant != tenant:
            raise ApiError(404, f"No such File object: {file_id[:80]}", param="file_id", code="not_found")
        return stored

    async def read(self, file_id: str, tenant: str | None) -> bytes:
        await self.get(file_id, tenant)
        content = await self._get(file_id)
        if content is None:
            raise _unavailable(OSError(f"{file_id}: its metadata is stored, its bytes are not"))
        return content

    async def _get(self, name: str) -> bytes | None:
        try:
            return await self.blobs.get(name)
        except OSError as error:
            raise _unavailable(error) from None


def _unavailable(error: OSError) -> ApiError:
    return ApiError(503, f"Kev's file store is not available ({str(error)[:200]}); try again later.",
                    code="file_store_unavailable")


def parse_upload(body: bytes, content_type: str | None) -> tuple[str, str, bytes]:
    """(filename, purpose, content) of a multipart/form-data upload, as `client.files.create` sends it."""
    if not content_type or not content_type.lower().startswith("multipart/form-data"):
        raise bad_request("Expected a multipart/form-data body with the fields `file` and `purpose`.",
                          code="invalid_request")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1", "replace")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts() if message.is_multipart() else ():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            fields[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
    if "file" not in fields:
        raise bad_request("Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
    if "purpose" not in fields:
        raise bad_request("Missing required parameter: 'purpose'.", param="purpose", code="missing_required_parameter")
    purpose = fields["purpose"][1].decode("utf-8", "replace").strip()
    if purpose != "batch":
        raise bad_request(f"purpose={purpose[:40]!r} is not supported by Kev: only 'batch' files are kept",
                          param="purpose", code="unsupported_value")
    filename, content = fields["file"]
    return (filename or "upload.jsonl")[:200], purpose, content
