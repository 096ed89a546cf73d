"""Codec benchmark: quality and speed of every codec × backend on fp16 vectors.

Prints bits/element, compression ratio vs fp16, normalised MSE ‖x−x̂‖²/‖x‖², mean cosine, and
encode/decode throughput in MB/s of fp16 input, each speed also as a ratio to a plain memory
copy of the same array measured in the same run (the machine is shared and noisy; ratios are
what to compare across runs).

Backends: ``numpy``/``torch`` are the reference array ops (``KVTOOL_KERNELS=reference``);
``numpy+numba``/``torch+numba`` the same inputs served by the compiled CPU kernels. The last
row is a peer: the ManthanQuant scheme (norm, ×√D, 8-level Gaussian Lloyd–Max, no rotation,
3-bit pack), in plain numpy (``benchmarks/peers.py``).

    python benchmarks/codecs.py          # 1M vectors, D=128, every codec and backend
    python benchmarks/codecs.py --vectors 200000 --codecs turbo3,int8 --backends torch+numba
    python benchmarks/codecs.py --codecs quality/k,quality/v,balanced/k,balanced/v,small/k,small/v
    python benchmarks/codecs.py --codecs "turbomix:bits=2,trellis=true;turbo3" --head-dim 256
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager

import numpy as np
from peers import ManthanQuant  # benchmarks/peers.py (this script's folder is on sys.path)

from kvtool.codecs import get_codec, list_codecs
from kvtool.kernels import available_backends, cpu_kernels
from kvtool.presets import PRESETS, preset_policy


@contextmanager
def kernels(backend: str):
    """KVTOOL_KERNELS for a backend label: ``x+numba`` compiled, plain ``x`` reference."""
    before = os.environ.get("KVTOOL_KERNELS")
    os.environ["KVTOOL_KERNELS"] = "compiled" if "+" in backend else "reference"
    try:
        yield
    finally:
        if before is None:
            del os.environ["KVTOOL_KERNELS"]
        else:
            os.environ["KVTOOL_KERNELS"] = before


def backend_labels() -> list[str]:
    compiled = cpu_kernels()
    labels = []
    for b in available_backends():
        labels += [b] + ([f"{b}+{compiled.name}"] if compiled is not None else [])
    return labels


def run_peer(chunks: list, repeats: int) -> dict:
    peer, dim = ManthanQuant(), chunks[0].shape[-1]
    fp16_bytes = sum(int(c.nbytes) for c in chunks)
    encoded = [peer.encode(c) for c in chunks]
    t_enc = best_seconds(lambda: [peer.encode(c) for c in chunks], repeats)
    t_dec = best_seconds(lambda: [peer.decode(e, dim) for e in encoded], repeats)
    x = np.concatenate(chunks).astype(np.float32)
    xh = np.concatenate([peer.decode(e, dim) for e in encoded]).astype(np.float32)
    cos = (x * xh).sum(-1) / np.maximum(np.linalg.norm(x, axis=-1) * np.linalg.norm(xh, axis=-1),
                                        1e-30)
    stored = sum(c.nbytes + n.nbytes for c, n in encoded)
    bits = stored * 8 / (fp16_bytes / 2)
    return {"codec": "manthanquant (peer)", "backend": "numpy", "bits": bits, "ratio": 16 / bits,
            "nmse": float(((x - xh) ** 2).sum() / (x**2).sum()), "cosine": float(cos.mean()),
            "enc_mbps": fp16_bytes / t_enc / 1e6, "dec_mbps": fp16_bytes / t_dec / 1e6}


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_mbps(x: np.ndarray, repeats: int) -> float:
    dst = np.empty_like(x)
    return x.nbytes / best_seconds(lambda: np.copyto(dst, x), repeats) / 1e6


PRESET_ROLES = {"k": "key", "v": "value"}


def codec_for(spec: str):
    """A codec spec, or a preset's key or value codec: ``quality/k``, ``balanced/v``."""
    name, sep, role = spec.partition("/")
    if sep and name in PRESETS and role in PRESET_ROLES:
        return getattr(preset_policy(name), PRESET_ROLES[role])
    return get_codec(spec)


def preset_specs() -> list[str]:
    return [f"{name}/{role}" for name in PRESETS if name != "lossless" for role in PRESET_ROLES]


def run_codec(codec_spec: str, backend: str, chunks: list, repeats: int) -> dict:
    codec = codec_for(codec_spec)
    if backend.startswith("torch"):
        import torch

        chunks = [torch.from_numpy(c) for c in chunks]
    fp16_bytes = sum(int(c.nbytes) for c in chunks)
    encoded = [codec.encode(c) for c in chunks]  # warm-up (codebooks, rotations, allocators)
    for e in encoded:
        codec.decode(e)
    t_enc = best_seconds(lambda: [codec.encode(c) for c in chunks], repeats)
    t_dec = best_seconds(lambda: [codec.decode(e) for e in encoded], repeats)
    err = ref = cos_sum = 0.0
    count = 0
    for c, e in zip(chunks, encoded, strict=True):
        x = np.asarray(c, dtype=np.float32)
        xh = np.asarray(codec.decode(e, "float32"), dtype=np.float32)
        err += float(((x - xh) ** 2).sum())
        ref += float((x**2).sum())
        nx, nxh = np.linalg.norm(x, axis=-1), np.linalg.norm(xh, axis=-1)
        cos_sum += float(((x * xh).sum(-1) / np.maximum(nx * nxh, 1e-30)).sum())
        count += x.shape[0]
    stored = sum(e.nbytes for e in encoded)
    bits = stored * 8 / (fp16_bytes / 2)
    return {
        "codec": codec_spec, "backend": backend, "bits": bits, "ratio": 16 / bits,
        "nmse": err / ref, "cosine": cos_sum / count,
        "enc_mbps": fp16_bytes / t_enc / 1e6, "dec_mbps": fp16_bytes / t_dec / 1e6,
    }


def split_specs(text: str) -> list[str]:
    """Codec specs from ``--codecs``: separated by ``;``, or by commas, where a piece with an
    option but no codec name (``trellis=true``) continues the spec before it."""
    if ";" in text:
        return [spec.strip() for spec in text.split(";") if spec.strip()]
    specs: list[str] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
        if specs and "=" in piece and ":" not in piece:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vectors", type=int, default=1 << 20)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=1 << 16, help="vectors per encode call")
    ap.add_argument("--codecs", default=",".join(list_codecs() + preset_specs()),
                    help="codec specs, or a preset's key or value codec (quality/k, small/v); "
                         "by commas, or by ';' (turbomix:bits=2,trellis=true;turbo3)")
    ap.add_argument("--backends", default=",".join(backend_labels()))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch and numba threads")
    ap.add_argument("--no-peer", action="store_true", help="skip the ManthanQuant row")
    args = ap.parse_args()
    known = backend_labels()
    unknown = [b for b in args.backends.split(",") if b not in known]
    if unknown:  # "numba" alone would silently time the reference ops
        ap.error(f"unknown backend {unknown[0]!r}; this machine has: {', '.join(known)}")

    if "torch" in args.backends:
        import torch

        torch.set_num_threads(args.threads)
    if cpu_kernels() is not None:
        import numba

        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.vectors, args.head_dim), dtype=np.float32).astype(np.float16)
    chunks = [x[i : i + args.chunk] for i in range(0, len(x), args.chunk)]
    copy = memcpy_mbps(x, 5)
    print(f"{args.vectors} vectors × D={args.head_dim} fp16 ({x.nbytes / 1e6:.0f} MB); "
          f"memory copy {copy:.0f} MB/s")
    specs = split_specs(args.codecs)
    width = max(22, *(len(spec) + 2 for spec in specs))
    header = (f"{'codec':<{width}}{'backend':<13}{'bits':>6}{'ratio':>7}{'nMSE':>9}{'cosine':>8}"
              f"{'enc MB/s':>10}{'(×copy)':>9}{'dec MB/s':>10}{'(×copy)':>9}")
    print(header)
    print("-" * len(header))
    def show(r: dict) -> None:
        print(f"{r['codec']:<{width}}{r['backend']:<13}{r['bits']:>6.3f}{r['ratio']:>7.2f}"
              f"{r['nmse']:>9.5f}{r['cosine']:>8.4f}{r['enc_mbps']:>10.0f}"
              f"{r['enc_mbps'] / copy:>9.3f}{r['dec_mbps']:>10.0f}{r['dec_mbps'] / copy:>9.3f}")

    for spec in specs:
        for backend in args.backends.split(","):
            with kernels(backend):
                show(run_codec(spec, backend, chunks, args.repeats))
    if not args.no_peer:
        show(run_peer(chunks, args.repeats))
    # memory copy again, so drift over a long run shows
    print(f"memory copy at end: {memcpy_mbps(x, 5):.0f} MB/s")


if __name__ == "__main__":
    main()
