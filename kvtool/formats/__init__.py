"""The .kvz v1 file format (see ``docs/format.md``): save, load, lazy access, transcoding."""

from kvtool.formats.constants import FORMAT_VERSION
from kvtool.formats.reader import KvzFile, load, open_kvz
from kvtool.formats.transcode import transcode
from kvtool.formats.writer import save

__all__ = ["FORMAT_VERSION", "KvzFile", "load", "open_kvz", "save", "transcode"]
