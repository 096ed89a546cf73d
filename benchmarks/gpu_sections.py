"""The kernel tables of ``benchmarks/gpu.py``: turbo throughput, dtypes, decode attention, presets.

Each section prints its table row by row and returns ``{"rows": [...], "skipped": [...]}``
(rows are flat dicts of labels and finite numbers, for ``--json``). Throughput counts
fp16-equivalent bytes, ``vectors * D * 2``, in every column and dtype, so cells compare as
vectors per second; "% copy" is the share of ``dst.copy_(src)`` on the same fp16 array, timed
in the same run (the copy itself moves twice those bytes).
"""

from __future__ import annotations

from typing import Any

from gpu_common import (  # benchmarks/ is the script's directory
    Bench,
    Table,
    device_work,
    human,
    rate,
    us,
    waits_text,
)

SEED = 0x6B76
OVERHEAD_COLUMNS = ["host µs", "codes graph", "sdpa graph"]
OVERHEAD_NOTE = ("host µs: the CPU's cost of issuing one codes call (launches, checks); codes/"
                 "sdpa graph: µs per call replayed from a CUDA graph (device time alone)")
DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _copy_ms(b: Bench, x: Any) -> float:
    dst = b.torch.empty_like(x)
    ms = b.clock.median_ms(lambda: dst.copy_(x))
    b.clock.last = None  # the copy must not stay allocated while the codecs run
    return ms


def _codec_ms(b: Bench, x: Any, bits: int, out_dtype: Any) -> tuple[float, float, float]:
    """(encode ms, decode ms, relative MSE) of turbo<bits> on ``x`` (decoded to ``out_dtype``)."""
    tc, clock = b.tc, b.clock
    enc = clock.median_ms(lambda: tc.turbo_encode(x, bits, SEED))
    codes, norms = tc.turbo_encode(x, bits, SEED)
    norms = norms.half()  # as the codec stores them
    dim = x.shape[-1]
    dec = clock.median_ms(lambda: tc.turbo_decode(codes, norms, dim, bits, SEED, out_dtype))
    sample = x[: 1 << 16].float()
    err = tc.turbo_decode(codes[: 1 << 16], norms[: 1 << 16], dim, bits, SEED, out_dtype).float()
    mse = ((err - sample) ** 2).sum().item() / max((sample**2).sum().item(), 1e-30)
    clock.last = None
    return enc, dec, mse


def _fits(b: Bench, nbytes: float) -> tuple[bool, str]:
    """Whether ``nbytes`` fit in free device memory (always on the CPU)."""
    if b.device != "cuda":
        return True, ""
    b.torch.cuda.empty_cache()
    free, _ = b.torch.cuda.mem_get_info()
    return nbytes <= free, f"needs ~{nbytes / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"


def throughput(b: Bench) -> dict:
    """turbo<bits> encode (fp16 in) / decode (fp16 out) GB/s and % of the copy per (D, vectors)."""
    torch, args = b.torch, b.args
    head = ["D", "vectors", "copy GB/s"] + [f"{op} t{bits}" for bits in args.bits
                                            for op in ("enc", "dec")]
    table = Table("turbo encode (fp16 in) / decode (fp16 out): GB/s of fp16-equivalent bytes "
                  "(vectors*D*2) and % of the device copy", head,
                  [4, 7, 9] + [12] * (2 * len(args.bits)))
    rows = []
    for n in args.vectors:
        for dim in args.dims:
            label = f"D={dim} vectors={human(n)}"
            size = n * dim * 2
            ok, why = _fits(b, 2.3 * size)  # x, the decoded copy and the codes
            if not ok:
                table.note(f"{label}: skipped, {why}")
                b.deadline.skipped.append(f"{label} (memory)")
                continue
            if not b.deadline.allows(label):
                continue
            with b.deadline.attempt(label) as attempt:
                x = torch.randn((n, dim), device=b.device, dtype=torch.float16)
                copy = _copy_ms(b, x)
                row: dict[str, Any] = {"dim": dim, "vectors": n, "copy_gbs": size / copy / 1e6}
                cells = [str(dim), human(n), f"{row['copy_gbs']:.0f}"]
                for bits in args.bits:
                    enc, dec, mse = _codec_ms(b, x, bits, torch.float16)
                    for op, ms in (("encode", enc), ("decode", dec)):
                        row[f"{op}_turbo{bits}_gbs"] = size / ms / 1e6
                        row[f"{op}_turbo{bits}_pct_copy"] = 100 * copy / ms
                        cells.append(rate(size / ms / 1e6, 100 * copy / ms))
                    row[f"turbo{bits}_rel_mse"] = mse
            x = None
            if attempt.failed:
                continue
            rows.append(row)
            table.row(cells)
    return {"rows": rows}


def dtypes(b: Bench) -> dict:
    """turbo<dtype-bits> encode from / decode to each dtype at one D, next to the fp16 copy."""
    torch, args = b.torch, b.args
    dim = 128 if 128 in args.dims else args.dims[0]
    n, bits = min(args.vectors), args.dtype_bits
    size = n * dim * 2
    table = Table(f"turbo{bits} by dtype, D={dim}, {human(n)} vectors: encode from / decode to "
                  "the dtype, GB/s of fp16-equivalent bytes and % of the fp16 copy",
                  ["dtype", "encode", "decode", "rel MSE"], [6, 12, 12, 8])
    ok, why = _fits(b, size * 2 * 2.3)  # an fp32 x and its fp32 decode
    if not ok:
        table.note(f"skipped, {why}")
        return {"rows": [], "skipped": [f"D={dim} vectors={human(n)} (memory)"]}
    x16 = torch.randn((n, dim), device=b.device, dtype=torch.float16)
    copy = _copy_ms(b, x16)
    rows = []
    for name in args.dtypes:
        if not b.deadline.allows(name):
            continue
        with b.deadline.attempt(name) as attempt:
            dtype = getattr(torch, DTYPE_NAMES[name])
            enc, dec, mse = _codec_ms(b, x16.to(dtype), bits, dtype)
        if attempt.failed:
            continue
        row = {"dtype": name, "dim": dim, "vectors": n, "bits": bits,
               "copy_fp16_gbs": size / copy / 1e6, "rel_mse": mse}
        cells = [name]
        for op, ms in (("encode", enc), ("decode", dec)):
            row[f"{op}_gbs"], row[f"{op}_pct_copy"] = size / ms / 1e6, 100 * copy / ms
            cells.append(rate(size / ms / 1e6, 100 * copy / ms))
        rows.append(row)
        table.row(cells + [f"{mse:.4f}"])
    return {"rows": rows, "copy_fp16_gbs": size / copy / 1e6}


def decode_attention_fn(tc: Any) -> tuple[Any, str]:
    """``turbo_decode_attention`` of :mod:`kvtool.kernels.triton_attention` where that module
    exists, else :mod:`kvtool.kernels.triton_cuda`'s (same signature), and the module's name."""
    try:
        from kvtool.kernels import triton_attention
    except ImportError:
        triton_attention = None
    fn = getattr(triton_attention, "turbo_decode_attention", None)
    if fn is not None:
        return fn, "kvtool.kernels.triton_attention"
    return tc.turbo_decode_attention, "kvtool.kernels.triton_cuda"


def _attention_row(b: Bench, attend: Any, batch: int, n: int) -> dict:
    torch, tc, args, clock = b.torch, b.tc, b.args, b.clock
    sdpa_fn = torch.nn.functional.scaled_dot_product_attention
    hq, hkv, dim, kb, vb, ks, vs = (args.heads, args.kv_heads, args.head_dim, args.k_bits,
                                    args.v_bits, 11, 12)
    scale = dim**-0.5
    q = torch.randn((batch, hq, dim), device=b.device, dtype=torch.float16)
    kc, kn = tc.turbo_encode(torch.randn((batch, hkv, n, dim), device=b.device,
                                         dtype=torch.float16), kb, ks)
    vc, vn = tc.turbo_encode(torch.randn((batch, hkv, n, dim), device=b.device,
                                         dtype=torch.float16), vb, vs)
    kn, vn = kn.half(), vn.half()
    split = {} if args.split_k is None else {"split_k": args.split_k}

    def codes():
        return attend(q, kc, kn, vc, vn, dim=dim, k_bits=kb, k_seed=ks, v_bits=vb, v_seed=vs,
                      scale=scale, **split)

    def sdpa(kd, vd):
        return sdpa_fn(q[:, :, None], kd, vd, scale=scale, enable_gqa=hq != hkv)[:, :, 0]

    def decoded():
        return (tc.turbo_decode(kc, kn, dim, kb, ks, torch.float16),
                tc.turbo_decode(vc, vn, dim, vb, vs, torch.float16))

    t_codes = clock.median_ms(codes)
    got = clock.last
    t_decode = clock.median_ms(lambda: sdpa(*decoded()))
    kd, vd = decoded()
    t_sdpa = clock.median_ms(lambda: sdpa(kd, vd))
    diff = (got.float() - clock.last.float()).abs().max().item()
    return {"batch": batch, "tokens": n, "codes_us": t_codes * 1e3, "sdpa_fp16_us": t_sdpa * 1e3,
            "decode_sdpa_us": t_decode * 1e3, "speedup_vs_sdpa_fp16": t_sdpa / t_codes,
            "speedup_vs_decode_sdpa": t_decode / t_codes, "max_abs_diff": diff,
            "kv_bytes_codes": sum(t.numel() * t.element_size() for t in (kc, kn, vc, vn)),
            "kv_bytes_fp16": 2 * batch * hkv * n * dim * 2, **_overheads(b, codes,
                                                                          lambda: sdpa(kd, vd))}


def _overheads(b: Bench, codes: Any, sdpa: Any) -> dict:
    """Where a call's time goes: the host's launch cost of the codes call, and the codes and
    SDPA calls replayed from CUDA graphs (device time alone; None off CUDA)."""
    graph_codes, graph_sdpa = b.clock.graph_ms(codes), b.clock.graph_ms(sdpa)
    return {"codes_host_us": b.clock.host_us(codes),
            "codes_graph_us": None if graph_codes is None else graph_codes * 1e3,
            "sdpa_graph_us": None if graph_sdpa is None else graph_sdpa * 1e3}


def _overhead_cells(row: dict) -> list[str]:
    return [f"{row['codes_host_us']:.1f}", us(_ms(row["codes_graph_us"])),
            us(_ms(row["sdpa_graph_us"]))]


def _ms(value_us: float | None) -> float | None:
    return None if value_us is None else value_us / 1e3


def attention(b: Bench) -> dict:
    """Decode attention from codes vs SDPA on fp16 K/V and vs decode + SDPA, per (B, tokens)."""
    args = b.args
    attend, source = decode_attention_fn(b.tc)
    table = Table(f"decode attention (one query per sequence), Hq={args.heads} "
                  f"Hkv={args.kv_heads} D={args.head_dim}, keys turbo{args.k_bits}, values "
                  f"turbo{args.v_bits}: µs per call; speedup = other / codes\n"
                  f"  codes: {source}.turbo_decode_attention; sdpa fp16: SDPA on fp16 K/V (what "
                  "DynamicCache pays); dec+sdpa: turbo_decode of K and V, then SDPA\n"
                  f"  {OVERHEAD_NOTE}",
                  ["B", "tokens", "codes", "sdpa fp16", "dec+sdpa", "x sdpa", "x dec+sdpa",
                   "max|diff|", *OVERHEAD_COLUMNS], [3, 6, 9, 9, 9, 7, 10, 9, 9, 11, 11])
    rows = []
    for batch in args.batches:
        for n in args.tokens:
            label = f"B={batch} tokens={human(n)}"
            if not b.deadline.allows(label):
                continue
            with b.deadline.attempt(label) as attempt:
                row = _attention_row(b, attend, batch, n)
            if attempt.failed:
                continue
            rows.append(row)
            table.row([str(batch), human(n), f"{row['codes_us']:.1f}",
                       f"{row['sdpa_fp16_us']:.1f}", f"{row['decode_sdpa_us']:.1f}",
                       f"{row['speedup_vs_sdpa_fp16']:.2f}x",
                       f"{row['speedup_vs_decode_sdpa']:.2f}x", f"{row['max_abs_diff']:.1e}",
                       *_overhead_cells(row)])
            if b.device == "cuda":
                b.torch.cuda.empty_cache()
    return {"rows": rows, "kernel": source, "preset_rows": preset_attention(b)}


def _preset_attention_row(b: Bench, name: str, batch: int, n: int) -> dict:
    """One preset's keys and values, encoded as ``CompressedCache`` stores them (blocks of 64),
    attended from their codes by the kernel the cache uses on this device, against decoding
    them and running SDPA, and SDPA on fp16 K/V. The kernel's views of the store (built once
    per store change) are not timed."""
    from kvtool.engines.hf_attention import rotation_seeds, scalar_codes
    from kvtool.kernels import triton_attention, triton_attention_parts
    from kvtool.presets import preset_policy

    torch, args, clock = b.torch, b.args, b.clock
    hq, hkv, dim, block = args.heads, args.kv_heads, args.head_dim, 64
    n = max(block, n // block * block)
    policy, heads, scale = preset_policy(name), batch * hkv, dim**-0.5
    q = torch.randn((batch, hq, 1, dim), device=b.device, dtype=torch.float16)
    shape = (batch, hkv, n // block, block, dim)
    k, v = (torch.randn(shape, device=b.device, dtype=torch.float16) for _ in range(2))
    kenc, venc = policy.key.encode(k), policy.value.encode(v)
    if scalar_codes(policy.key, "key") and scalar_codes(policy.value):
        ka, va = kenc.arrays, venc.arrays
        kernel = "triton_attention"
        store = triton_attention.prepare(
            ka["codes"].reshape(heads, n, -1), ka["norms"].reshape(heads, n),
            va["codes"].reshape(heads, n, -1), va["norms"].reshape(heads, n), dim=dim,
            k_bits=policy.key.bits, v_bits=policy.value.bits,
            k_seeds=rotation_seeds(policy.key), v_seeds=rotation_seeds(policy.value),
            k_rotations=ka["rotation"].reshape(heads, -1),
            v_rotations=va["rotation"].reshape(heads, -1),
            key_means=ka["mean"].reshape(heads, -1, dim) if "mean" in ka else None, block=block)

        def codes():
            return triton_attention.attend_store(q, store, scale=scale)
    else:
        roles = [triton_attention_parts.role_tensors(c, e.arrays, heads, n, block, dim)
                 for c, e in ((policy.key, kenc), (policy.value, venc))]
        kernel = "triton_attention_parts"

        def codes():
            return triton_attention_parts.attend(q, *roles, scale=scale)

    def sdpa(kd, vd):
        return torch.nn.functional.scaled_dot_product_attention(
            q, kd, vd, scale=scale, enable_gqa=hq != hkv).transpose(1, 2)

    def decoded():
        return (policy.key.decode(kenc).reshape(batch, hkv, n, dim).half(),
                policy.value.decode(venc).reshape(batch, hkv, n, dim).half())

    t_codes = clock.median_ms(codes)
    got = clock.last
    t_decode = clock.median_ms(lambda: sdpa(*decoded()))
    diff = (got.float() - clock.last.float()).abs().max().item()
    t_sdpa = clock.median_ms(lambda: sdpa(k.reshape(batch, hkv, n, dim),
                                          v.reshape(batch, hkv, n, dim)))
    return {"preset": name, "kernel": kernel, "batch": batch, "tokens": n,
            "codes_us": t_codes * 1e3, "sdpa_fp16_us": t_sdpa * 1e3,
            "decode_sdpa_us": t_decode * 1e3, "speedup_vs_sdpa_fp16": t_sdpa / t_codes,
            "speedup_vs_decode_sdpa": t_decode / t_codes, "max_abs_diff": diff,
            "kv_bytes_codes": kenc.nbytes + venc.nbytes, "kv_bytes_fp16": 2 * k.numel() * 2,
            **_overheads(b, codes, lambda: sdpa(k.reshape(batch, hkv, n, dim),
                                                v.reshape(batch, hkv, n, dim)))}


def preset_attention(b: Bench) -> list[dict]:
    """The presets' codes attended on the device (the table of :func:`attention`, per preset)."""
    args = b.args
    table = Table(f"decode attention from the presets' codes, Hq={args.heads} Hkv={args.kv_heads}"
                  f" D={args.head_dim}, blocks of 64: µs per call; speedup = other / codes\n"
                  "  codes: quality through triton_attention, balanced/small through "
                  "triton_attention_parts; dec+sdpa: codec.decode of K and V, then SDPA\n"
                  f"  {OVERHEAD_NOTE}",
                  ["preset", "B", "tokens", "codes", "sdpa fp16", "dec+sdpa", "x sdpa",
                   "x dec+sdpa", "max|diff|", *OVERHEAD_COLUMNS],
                  [8, 3, 6, 9, 9, 9, 7, 10, 9, 9, 11, 11])
    rows = []
    for name in args.attention_presets:
        for batch in args.batches:
            for n in args.tokens:
                label = f"{name} B={batch} tokens={human(n)}"
                if not b.deadline.allows(label):
                    continue
                with b.deadline.attempt(label) as attempt:
                    row = _preset_attention_row(b, name, batch, n)
                if attempt.failed:
                    continue
                rows.append(row)
                table.row([name, str(batch), human(row["tokens"]), f"{row['codes_us']:.1f}",
                           f"{row['sdpa_fp16_us']:.1f}", f"{row['decode_sdpa_us']:.1f}",
                           f"{row['speedup_vs_sdpa_fp16']:.2f}x",
                           f"{row['speedup_vs_decode_sdpa']:.2f}x", f"{row['max_abs_diff']:.1e}",
                           *_overhead_cells(row)])
                if b.device == "cuda":
                    b.torch.cuda.empty_cache()
    return rows


def presets(b: Bench) -> dict:
    """Each preset's key and value codec through ``codec.encode``/``codec.decode``, GB/s; under
    each row, what one profiled call kept the device busy with (its three costliest kernels or
    ops) against the median call's wall time, and on CUDA the host's waits: where the presets'
    1–12% of the copy on the H100 goes."""
    from kvtool.kernels import compiled_for
    from kvtool.presets import preset_policy

    torch, args, clock = b.torch, b.args, b.clock
    dim, block = args.head_dim, 64
    n = max(block, args.preset_vectors // block * block)
    size = n * dim * 2
    # laid out like CompressedCache's encode calls: [blocks, block tokens, D] (one mean, outlier
    # set and candidate rotation per block of 64 tokens)
    x = torch.randn((n // block, block, dim), device=b.device, dtype=torch.float16)
    copy = _copy_ms(b, x)
    kernels = getattr(compiled_for(x), "name", None) or "numpy reference"
    table = Table(f"presets through the codec API: {human(n)} x {dim} fp16 on {b.device} as "
                  f"[{human(n // block)} blocks, {block}, {dim}] ({kernels} kernels); GB/s and "
                  f"% of the copy ({size / copy / 1e6:.0f} GB/s)",
                  ["preset", "role", "bits/elem", "encode", "decode", "rel MSE"],
                  [8, 5, 9, 12, 12, 8])
    rows = []
    for name in args.presets:
        policy = preset_policy(name)
        for role in args.roles:
            label = f"{name} {role}"
            if not b.deadline.allows(label):
                continue
            codec = getattr(policy, role)
            with b.deadline.attempt(label) as attempt:
                enc = codec.encode(x)
                t_enc = clock.median_ms(lambda c=codec: c.encode(x))
                t_dec = clock.median_ms(lambda c=codec, e=enc: c.decode(e))
                err = codec.decode(enc).float() - x.float()
                mse = (err**2).sum().item() / (x.float() ** 2).sum().item()
                work = {step: device_work(b, fn)[1:] for step, fn in (
                    ("encode", lambda c=codec: c.encode(x)),
                    ("decode", lambda c=codec, e=enc: c.decode(e)))}
            if attempt.failed:
                continue
            config = " ".join(f"{k}={v}" for k, v in codec.get_config().items())
            row = {"preset": name, "role": role, "codec": config,
                   "bits_per_element": codec.bits_per_element(dim), "rel_mse": mse,
                   "encode_gbs": size / t_enc / 1e6, "encode_pct_copy": 100 * copy / t_enc,
                   "decode_gbs": size / t_dec / 1e6, "decode_pct_copy": 100 * copy / t_dec}
            for step, (busy, top, waits) in work.items():
                row.update({f"{step}_busy_ms": busy, f"{step}_top": top,
                            f"{step}_waits": waits})
            rows.append(row)
            table.row([name, role, f"{row['bits_per_element']:.2f}",
                       rate(row["encode_gbs"], row["encode_pct_copy"]),
                       rate(row["decode_gbs"], row["decode_pct_copy"]), f"{mse:.4f}"])
            for step, wall in (("encode", t_enc), ("decode", t_dec)):
                Table.note(f"{step}: device busy {row[f'{step}_busy_ms']:.3f} of {wall:.3f} ms; "
                           + ", ".join(f"{k} {ms:.3f}" for k, ms in row[f"{step}_top"][:3])
                           + (f"; host waits: {waits_text(row[f'{step}_waits'])}"
                              if b.device == "cuda" else ""))
    return {"rows": rows, "copy_gbs": size / copy / 1e6, "kernels": kernels}
