"""Object stores the snapshot repository writes to: a POSIX directory or an S3-compatible bucket.

Both expose the same five calls on flat keys (``chunks/ab/abcd...``). A ``put`` is atomic: a
reader sees the whole object or none of it (a rename on POSIX; a single PUT on S3), which is
what lets a manifest written last make a commit visible all at once.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from aenv.errors import ArtifactDamaged, InvalidRequest, RepositoryUnavailable, StorageError
from aenv.storage import datadir

CHANGE_LOCK_WAIT_S = 10.0  # a conditional change holds its lock for milliseconds
CHANGE_LOCK_STALE_S = 60.0  # a lock this old was left by a process that died holding it
MAX_OBJECT = 64 << 20  # the most an object is read (whole, in memory): a manifest of ~800k chunks


class _ConditionFailed(StorageError):
    """A conditional write that the store refused: its condition no longer held (always caught)."""


class _RangeNotSatisfiable(StorageError):
    """A range read starting past the object's end (S3's 416, always caught)."""


class MissingObject(KeyError):
    """The key is not in the store."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    modified: float  # seconds since the epoch


class Backend(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...

    def put_new(self, key: str, data: bytes) -> bool:
        """Create the object only if there is none; False (and nothing written) if there is."""
        ...

    def get(self, key: str) -> bytes:
        """The object's bytes; :class:`MissingObject` if there is none."""
        ...

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and a tag that changes whenever it is rewritten."""
        ...

    def replace(self, key: str, data: bytes, tag: str) -> bool:
        """Overwrite the object only while it is the version ``tag`` names; False (and nothing
        written) if it was rewritten or removed since: a rewrite never brings back a deleted object."""
        ...

    def remove(self, key: str) -> None:
        """Remove one object, never in the middle of a :meth:`replace` of it."""
        ...

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int:
        """The object's size in bytes; :class:`MissingObject` if there is none."""
        ...

    def get_range(self, key: str, start: int, length: int) -> tuple[bytes, int]:
        """(at most ``length`` bytes of the object from ``start``, the object's whole size): fewer
        bytes, or none, where the object ends before; :class:`MissingObject` if there is none."""
        ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]: ...

    def delete(self, keys: Sequence[str]) -> None:
        """Remove objects; keys that are already gone are not an error."""
        ...


KEY_DEPTH = 2  # directories a key has (chunks/ab/<sha256>, entries/templates/<id>.json)


class PosixBackend:
    """Objects as files under a root directory (local disk or a shared mount)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"
        try:
            datadir.private_dir(root)  # what templates and snapshots hold: the node's alone
        except OSError as exc:
            raise RepositoryUnavailable(f"cannot create the repository directory {root}: {exc}") from exc

    def _walk(self, base: Path) -> Iterator[tuple[str, list[str]]]:
        """(directory, file names) below ``base``, no deeper than keys go: whoever else writes
        the directory could put a tree there thousands deep, and os.walk recurses (a listing that
        overflowed the stack stopped every node sharing the repository from starting)."""
        top = len(self.root.parts)
        for dirpath, dirnames, filenames in os.walk(base):
            if len(Path(dirpath).parts) - top >= KEY_DEPTH:
                dirnames[:] = []  # os.walk goes only into what is left here
            yield dirpath, filenames

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise InvalidRequest(f"bad repository key {key!r}")
        return self.root / key

    def _staged(self, key: str, data: bytes) -> tuple[Path, str]:
        """(final path, a synced temp file beside it holding ``data``)."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".put-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # the manifest naming this object may be written next
        except BaseException:
            os.unlink(tmp)
            raise
        return path, tmp

    def put(self, key: str, data: bytes) -> None:
        path, tmp = self._staged(key, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def put_new(self, key: str, data: bytes) -> bool:
        path, tmp = self._staged(key, data)
        try:
            os.link(tmp, path)  # atomic, and fails if the name exists
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        return True

    def get(self, key: str) -> bytes:
        return self._read(key)[0]

    def _read(self, key: str) -> tuple[bytes, os.stat_result]:
        """An object's bytes: a regular file, never a link, a FIFO or a device that another writer
        of a shared directory left in its place (they could stall the node or fill its memory)."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise MissingObject(key) from None
        except OSError as exc:  # ELOOP: a symbolic link
            raise ArtifactDamaged(f"repository object {key} cannot be read: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            # Asks for what fstat says (plus one: a file growing meanwhile is not read past the limit);
            # read(MAX_OBJECT + 1) took a 64 MiB buffer for every manifest.
            data = f.read(min(st.st_size, MAX_OBJECT) + 1) if stat.S_ISREG(st.st_mode) else b""
            if not stat.S_ISREG(st.st_mode) or len(data) > MAX_OBJECT:
                raise ArtifactDamaged(f"repository object {key} is not a file of at most {MAX_OBJECT >> 20} MiB")
            return data, st

    # Every put is a new inode (a temp file renamed into place), so inode + mtime + size name a
    # version. Conditional changes hold a lock file beside the object for the check and the change:
    # O_EXCL creation is atomic on local disks and NFS alike.
    @staticmethod
    def _tag(st: os.stat_result) -> str:
        return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        data, st = self._read(key)
        return data, self._tag(st)

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[Path]:
        path = self._path(key)
        lock = path.with_name(f".lock-{path.name}")
        if not path.parent.is_dir():  # no directory, so no object: nothing to change or guard
            yield path
            return
        deadline = time.monotonic() + CHANGE_LOCK_WAIT_S
        while True:
            try:
                os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                break
            except FileExistsError:
                try:
                    if time.time() - lock.stat().st_mtime > CHANGE_LOCK_STALE_S:  # its holder died
                        lock.unlink(missing_ok=True)
                        continue
                except FileNotFoundError:
                    continue
                if time.monotonic() > deadline:
                    waited = f"{CHANGE_LOCK_WAIT_S:.0f} s"
                    raise RepositoryUnavailable(f"{key} stayed locked for {waited} ({lock})") from None
                time.sleep(0.005)
        try:
            yield path
        finally:
            lock.unlink(missing_ok=True)

    def _is_version(self, path: Path, tag: str) -> bool:
        try:
            return self._tag(os.stat(path)) == tag
        except FileNotFoundError:
            return False

    def replace(self, key: str, data: bytes, tag: str) -> bool:
        with self._locked(key) as path:
            if not self._is_version(path, tag):
                return False
            self.put(key, data)
            return True
        return False

    def remove(self, key: str) -> None:
        with self._locked(key) as path:
            path.unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    @contextlib.contextmanager
    def _open_file(self, key: str) -> Iterator[tuple[int, os.stat_result]]:
        """A regular file's descriptor, never through a link, never a FIFO or a device."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise MissingObject(key) from None
        except OSError as exc:  # ELOOP: a symbolic link
            raise ArtifactDamaged(f"repository object {key} cannot be read: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ArtifactDamaged(f"repository object {key} is not a regular file")
            yield fd, st
        finally:
            os.close(fd)

    def size(self, key: str) -> int:
        with self._open_file(key) as (_, st):
            return st.st_size

    def get_range(self, key: str, start: int, length: int) -> tuple[bytes, int]:
        if start < 0 or not 0 <= length <= MAX_OBJECT:
            raise InvalidRequest(f"bad range {start}+{length} of {key}")
        with self._open_file(key) as (fd, st):
            data = os.pread(fd, length, start) if start < st.st_size else b""
            return data, st.st_size

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        if not base.is_dir():
            return
        for dirpath, filenames in self._walk(base):
            for name in filenames:
                if name.startswith((".put-", ".lock-")):
                    continue  # an interrupted put or a conditional change's lock: never an object
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                yield ObjectInfo(os.path.relpath(path, self.root), st.st_size, st.st_mtime)

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            try:
                self._path(key).unlink()
            except FileNotFoundError:
                pass

    def sweep_partial_puts(self, older_than: float) -> int:
        """Remove temp files of puts interrupted by a crash."""
        now, removed = time.time(), 0
        for dirpath, filenames in self._walk(self.root):
            for name in filenames:
                path = os.path.join(dirpath, name)
                try:
                    if name.startswith(".put-") and now - os.stat(path).st_mtime > older_than:
                        os.unlink(path)
                        removed += 1
                except FileNotFoundError:
                    continue
        return removed


class S3Backend:
    """Objects in an S3-compatible bucket under a key prefix (boto3; credentials from its usual
    chain: environment, shared config files, instance roles, unless given explicitly)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
    ) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise InvalidRequest("an s3:// repository needs boto3: pip install 'aenv[s3]'") from exc
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        config = Config(
            retries={"max_attempts": 5, "mode": "standard"},
            max_pool_connections=32,
            s3={"addressing_style": "path"} if endpoint else {},
        )
        kwargs: dict[str, Any] = {"endpoint_url": endpoint, "region_name": region, "config": config}
        if access_key_id and secret_access_key:
            kwargs.update(aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key)
        self._s3 = boto3.session.Session().client("s3", **kwargs)
        self._errors = self._s3.exceptions

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise _ConditionFailed(code) from None
            if code in ("NoSuchKey", "404", "NotFound"):
                raise MissingObject(kwargs.get("Key", "")) from None
            if code == "InvalidRange":
                raise _RangeNotSatisfiable(code) from None
            raise RepositoryUnavailable(f"{what} on {self.url} failed: {code or exc}") from exc
        except BotoCoreError as exc:
            raise RepositoryUnavailable(f"{what} on {self.url} failed: {exc}") from exc

    def put(self, key: str, data: bytes) -> None:
        self._call("put", self._s3.put_object, Key=self._key(key), Body=data)

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        return self._read(key)

    def _put_if(self, key: str, data: bytes, **condition: str) -> bool:
        try:
            self._call("put", self._s3.put_object, Key=self._key(key), Body=data, **condition)
        except (_ConditionFailed, MissingObject):  # If-Match on a key that is gone: 404
            return False
        return True

    def replace(self, key: str, data: bytes, tag: str) -> bool:
        return self._put_if(key, data, IfMatch=tag)

    def remove(self, key: str) -> None:
        self.delete([key])  # a rewrite racing it fails its If-Match, so nothing comes back

    def put_new(self, key: str, data: bytes) -> bool:
        return self._put_if(key, data, IfNoneMatch="*")

    def get(self, key: str) -> bytes:
        return self._read(key)[0]

    def _read(self, key: str) -> tuple[bytes, str]:
        """An object's bytes and ETag, at most `MAX_OBJECT` of them (it is held in memory)."""
        response = self._call("get", self._s3.get_object, Key=self._key(key))
        body = response["Body"]
        try:
            if int(response.get("ContentLength") or 0) > MAX_OBJECT:
                raise ArtifactDamaged(f"repository object {key} is larger than {MAX_OBJECT >> 20} MiB")
            return bytes(body.read()), str(response["ETag"])
        finally:
            body.close()

    def exists(self, key: str) -> bool:
        try:
            self._call("head", self._s3.head_object, Key=self._key(key))
        except MissingObject:
            return False
        return True

    def size(self, key: str) -> int:
        return int(self._call("head", self._s3.head_object, Key=self._key(key))["ContentLength"])

    def get_range(self, key: str, start: int, length: int) -> tuple[bytes, int]:
        if start < 0 or not 0 < length <= MAX_OBJECT:
            raise InvalidRequest(f"bad range {start}+{length} of {key}")
        wanted = f"bytes={start}-{start + length - 1}"
        try:
            response = self._call("get", self._s3.get_object, Key=self._key(key), Range=wanted)
        except _RangeNotSatisfiable:
            return b"", self.size(key)  # the object ends before ``start``
        body = response["Body"]
        try:
            total = _range_total(str(response.get("ContentRange") or ""))
            data = bytes(body.read(length + 1))  # a server that sends more than asked is cut off, not believed
            if total is None or len(data) > length:
                raise ArtifactDamaged(f"repository object {key}: the store answered a range read with something else")
            return data, total
        finally:
            body.close()

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": self._key(prefix)}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("list", self._s3.list_objects_v2, **kwargs)
            for obj in page.get("Contents", []):
                key = obj["Key"][len(self.prefix) :]
                yield ObjectInfo(key, int(obj["Size"]), obj["LastModified"].timestamp())
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def delete(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), 1000):  # the API's batch limit
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            out = self._call("delete", self._s3.delete_objects, Delete={"Objects": batch, "Quiet": True})
            errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                raise RepositoryUnavailable(f"delete on {self.url} failed: {errors[0]}")


def _range_total(content_range: str) -> int | None:
    """The object's size from a ``Content-Range: bytes a-b/total`` header."""
    _, _, total = content_range.rpartition("/")
    return int(total) if total.isdigit() else None


def open_backend(
    url: str,
    *,
    endpoint: str | None = None,
    region: str | None = None,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
) -> Backend:
    """``/path`` or ``file:///path`` -> :class:`PosixBackend`; ``s3://bucket/prefix`` -> :class:`S3Backend`."""
    try:
        parsed = urlparse(url)
    except ValueError as exc:  # a malformed bracketed host, on newer Pythons
        raise InvalidRequest(f"repository {url[:200]!r} is not a path or URL: {exc}") from None
    if parsed.scheme in ("", "file"):
        path = parsed.path if parsed.scheme else url
        if not path.startswith("/"):
            raise InvalidRequest(f"a file repository needs an absolute path, not {url!r}")
        return PosixBackend(Path(path))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise InvalidRequest(f"an s3 repository needs a bucket: s3://bucket/prefix, not {url!r}")
        return S3Backend(
            parsed.netloc,
            parsed.path,
            endpoint=endpoint,
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
        )
    raise InvalidRequest(f"unknown repository scheme in {url!r} (use a path, file:// or s3://)")
