"""Every constant of the .kvz v1 format: metadata keys, tensor names, dtypes, limits.

``docs/format.md`` is the normative description; this module is its single source in code.
"""

from __future__ import annotations

# -- identity and versioning -----------------------------------------------------------------------
FORMAT_NAME = "kvz"
FORMAT_MAJOR = 1  # readers refuse any other major version
FORMAT_MINOR = 0  # the newest minor version this reader knows every detail of
FORMAT_VERSION = "1"  # written to ``kvz.format_version``; "MAJOR" or "MAJOR.MINOR"
FILE_SUFFIX = ".kvz"

# ``__metadata__`` keys of the safetensors container (all values are strings)
META_FORMAT = "kvz.format"
META_FORMAT_VERSION = "kvz.format_version"
META_HEADER = "kvz.header"
META_HEADER_CRC32 = "kvz.header_crc32"

# -- safetensors container -------------------------------------------------------------------------
SAFETENSORS_METADATA_KEY = "__metadata__"
HEADER_LENGTH_BYTES = 8  # little-endian uint64 length of the JSON header
HEADER_ALIGNMENT = 8  # the JSON header is padded with spaces to a multiple of this
HEADER_PAD_BYTE = b" "
MAX_HEADER_BYTES = 16 * 1024 * 1024  # readers refuse larger headers before reading them
MAX_HEADER_SECONDS = 10.0  # and stop validating a header after this long
MAX_TENSORS = 1_000_000
MAX_NDIM = 8
MAX_LAYERS = 100_000
MAX_HEAD_DIM = 4096  # codecs may build [head_dim, head_dim] matrices
MAX_ZSTD_RATIO = 1 << 16  # a zstd frame cannot expand more than this (RLE blocks ~32768x)
# decode bombs: a file may decode to at most MAX_DECODED_RATIO x its size (at least
# MIN_DECODED_LIMIT bytes); the environment variable overrides it with a number of bytes
MAX_DECODED_RATIO = 64
MIN_DECODED_LIMIT = 64 * 1024 * 1024
ENV_MAX_DECODED = "KVTOOL_MAX_DECODED_BYTES"

# safetensors dtype string <-> kvtool dtype name (numpy-style, as in kvtool.kernels)
ST_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
DTYPE_TO_ST: dict[str, str] = {v: k for k, v in ST_DTYPES.items()}
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8,
    "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # dtypes a cache (and a segment) may have
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32", "f32": "float32", "float": "float32",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "bf16": "bfloat16",
}
TOKEN_DTYPES = ("int32", "int64")

# -- checksums and compression ---------------------------------------------------------------------
CHECKSUM_ALGORITHM = "crc32"  # zlib.crc32 (IEEE 802.3 polynomial) of the stored bytes
COMPRESSION_NONE = "none"
COMPRESSION_ZSTD = "zstd"
COMPRESSION_RANS = "rans"  # entropy-coded symbols (kvtool.codecs.entropy, format.md 6.2)
COMPRESSIONS = (COMPRESSION_NONE, COMPRESSION_ZSTD, COMPRESSION_RANS)
DEFAULT_ZSTD_LEVEL = 3
ZSTD_MAX_LEVEL = 22

# -- header (``kvz.header``) keys ------------------------------------------------------------------
ROLES = ("key", "value")
H_CREATOR = "creator"
H_MODEL = "model"
H_TOKENIZER = "tokenizer"
H_NUM_LAYERS = "num_layers"
H_NUM_TOKENS = "num_tokens"
H_DTYPE = "dtype"
H_TOKEN_IDS = "token_ids"
H_POLICY = "policy"
#: a policy with per-layer codecs (``policy`` is then null: older readers, which would check
#: the segments against its uniform part, skip the check and decode from the segments)
H_LAYER_POLICY = "layer_policy"
H_LAYER_INFO = "layer_info"
#: a prefix-store chunk's place: ``{"key": its chain key, "start": its first token's position}``
H_STORE_CHUNK = "store_chunk"
STORE_KEY_RE = r"[0-9a-f]{64}"  # a chain key: sha256, lowercase hex
#: the lossy steps the K/V went through before this file's codecs (codec ids, dtype casts
#: ``"float32->bfloat16"``): a sorted list of distinct strings, absent when there were none
H_LOSSY_SOURCES = "lossy_sources"
MAX_LOSSY_SOURCES = 64
MAX_LOSSY_SOURCE_CHARS = 128
H_LAYERS = "layers"
H_TENSORS = "tensors"

# -- tensor names: dotted lower_snake_case ---------------------------------------------------------
TOKENS_TENSOR = "tokens"
LAYERS_PREFIX = "layers"


def tensor_name(layer: int, role: str, segment: int, part: str) -> str:
    """Name of one encoded array, e.g. ``layers.3.key.0.codes``."""
    return f"{LAYERS_PREFIX}.{layer}.{role}.{segment}.{part}"


def normalize_dtype(dtype: str | None) -> str | None:
    """``fp16``/``float16``/``torch.float16`` → ``float16``; ``None`` stays ``None``."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.").lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected fp32, fp16 or bf16")
    return name
