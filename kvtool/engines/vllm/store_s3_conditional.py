"""Conditional S3 requests of the prefix store, and what it does on a server without them.

A new chunk is a PUT with ``If-None-Match: *`` (of two writers, one wins); a lossless writer
overwrites a lossy chunk by a PUT with ``If-Match`` its judged ETag, and a quarantine deletes
with ``If-Match``: an object rewritten since it was judged is left alone. An S3-compatible
server that refuses these headers (``UNSUPPORTED_CODES``) gets the plain request after a check
(an ``exists``, a HEAD of the ETag): not atomic, as nothing else on such a server is.
"""

from __future__ import annotations

from kvtool.engines.vllm.store_s3_common import UNSUPPORTED_CODES, error_code


class ConditionalRequests:
    """The conditional writes and deletes of :class:`~kvtool.engines.vllm.store_s3.S3Backend`
    (a mixin: it uses the backend's ``client``, ``bucket``, ``_key``, ``_error`` and
    ``_head``)."""

    def _put(self, name: str, data: bytes, *, create: bool = False) -> bool:
        """One PUT of the whole object; False if ``create`` and it exists already."""
        from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

        args = {"Bucket": self.bucket, "Key": self._key(name), "Body": data}
        try:
            self.client.put_object(**args, **({"IfNoneMatch": "*"} if create else {}))
        except (ClientError, ParamValidationError) as e:
            code = error_code(e)
            if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            if not create or (isinstance(e, ClientError) and code not in UNSUPPORTED_CODES):
                raise self._error(e, name, "write") from None
            try:  # a server without conditional writes: the exists() check above stands
                self.client.put_object(**args)
            except (BotoCoreError, ClientError) as e2:
                raise self._error(e2, name, "write") from None
        except BotoCoreError as e:
            raise self._error(e, name, "write") from None
        return True

    def _put_over(self, name: str, data: bytes, etag: str) -> bool:
        """One PUT over the object if its ETag is still ``etag``; False if it was rewritten
        since. Gone meanwhile: created anew. A server without conditional writes: the ETag is
        checked by a HEAD first (not atomic, as its other writes)."""
        from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

        args = {"Bucket": self.bucket, "Key": self._key(name), "Body": data}
        try:
            self.client.put_object(**args, IfMatch=etag)
        except (ClientError, ParamValidationError) as e:
            code = error_code(e)
            if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            if code in ("NoSuchKey", "404"):
                return self._put(name, data, create=True)
            if isinstance(e, ClientError) and code not in UNSUPPORTED_CODES:
                raise self._error(e, name, "write") from None
            try:
                if self._head(name, "write").get("ETag") != etag:
                    return False
            except FileNotFoundError:
                return self._put(name, data, create=True)
            return self._put(name, data)
        except BotoCoreError as e:
            raise self._error(e, name, "write") from None
        return True

    def _delete_if_match(self, name: str, etag: str, action: str = "remove") -> bool:
        """Delete the object if its ETag is still ``etag``; False if it was rewritten or
        removed meanwhile. A server (or botocore) without conditional deletes deletes it."""
        from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name), IfMatch=etag)
        except (ClientError, ParamValidationError) as e:
            code = error_code(e)
            if code in ("PreconditionFailed", "NoSuchKey"):
                return False
            if code not in UNSUPPORTED_CODES and isinstance(e, ClientError):
                raise self._error(e, name, action) from None
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self._key(name))
            except (BotoCoreError, ClientError) as e2:
                raise self._error(e2, name, action) from None
        except BotoCoreError as e:
            raise self._error(e, name, action) from None
        return True
