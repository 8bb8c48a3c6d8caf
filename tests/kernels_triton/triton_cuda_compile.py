"""Compile every Triton kernel for a CUDA GPU on a machine without one (run as a script).

Triton's front end and NVIDIA back end (with its bundled ptxas) run on the CPU: this builds each
kernel down to a cubin for ``sm_<arch>`` in the variants the launchers use (float32 and bfloat16,
every quantized format, FP8 weights, soft-capped attention, MLA's wide latent heads), which catches
what the interpreter never checks (typing of branches, native bfloat16 ``tl.dot``, early returns,
16-row dot minimums, shared memory past sm_90's). It must run with ``TRITON_INTERPRET`` off, so the
kernels are defined as JIT functions: the test runs it in a subprocess. Prints one JSON object:
{variant: "ok" or the error}.
"""

from __future__ import annotations

import json
import os
import sys


def variants() -> dict[str, tuple[object, dict[str, str], dict[str, object]]]:
    """name -> (kernel, pointer types, constexpr values); other args: i32, or fp32 for scale/eps."""
    from protoserve.kernels.triton import (
        fp8_matmul,
        moe,
        norm_rope,
        paged_attention,
        prefill_attention,
        quantized_matmul,
    )
    from protoserve.kernels.triton._common import key_tile

    out: dict[str, tuple[object, dict[str, str], dict[str, object]]] = {}
    index = {"table_ptr": "*i32", "start_ptr": "*i32", "seq_len_ptr": "*i32"}
    # (pool, padded head size, soft cap): GQA heads of 128 plain and capped (Gemma 2), and MLA's latent
    # heads (DeepSeek's 576, padded to 1024) in float32, the pool whose tiles take the most shared memory.
    for pool, block_d, softcap in (("fp32", 128, False), ("bf16", 128, False), ("fp32", 128, True),
                                   ("bf16", 128, True), ("fp32", 1024, False)):
        bf16 = pool == "bf16"
        name = pool + ("-softcap" if softcap else "") + ("-mla" if block_d > 128 else "")
        ptrs = {"q_ptr": "*bf16", "k_ptr": f"*{pool}", "v_ptr": f"*{pool}", "out_ptr": "*fp32", **index}
        flags = {"BLOCK_N": key_tile(block_d, cpu=False), "BLOCK_D": block_d, "BF16": bf16, "BF16_DOT": bf16,
                 "SOFTCAP": softcap}
        out[f"prefill_attention/{name}"] = (prefill_attention._prefill_attention_kernel, ptrs, {"BLOCK_M": 16, **flags})
        out[f"paged_decode/{name}"] = (paged_attention._paged_decode_kernel, ptrs, {"BLOCK_G": 16, **flags})
    for fmt, code in quantized_matmul.FORMATS.items():
        data, meta = ("*i8", "*fp32") if fmt == "int8" else ("*u8", "*fp32" if fmt == "int4" else "*fp16")
        ptrs = {"x_ptr": "*bf16", "data_ptr": data, "scale_ptr": meta, "min_ptr": meta, "bias_ptr": "*fp32",
                "out_ptr": "*fp32"}  # fmt: skip
        consts = {"FMT": code, "HAS_BIAS": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32}
        out[f"quantized_matmul/{fmt}"] = (quantized_matmul._quantized_matmul_kernel, ptrs, consts)
    for x_dtype in ("fp32", "bf16", "fp16"):  # the E4M3 conversion to each dot dtype the launcher uses
        ptrs = {"x_ptr": f"*{x_dtype}", "codes_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "bias_ptr": "*fp32",
                "out_ptr": "*fp32"}  # fmt: skip
        tiles = {"BLOCK_M": fp8_matmul.BLOCK_M, "BLOCK_N": 32, "BLOCK_K": 256}  # the launcher's GPU_TILES
        consts = {"HAS_BIAS": True, "LOW_DOT": x_dtype != "fp32", **tiles}
        out[f"fp8_matmul/{x_dtype}"] = (fp8_matmul._fp8_matmul_kernel, ptrs, consts)
    norm_ptrs = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}
    for residual in (False, True):
        consts = {"HAS_RESIDUAL": residual, "RES_BF16": True, "OUT_BF16": True, "BLOCK_D": 4096}
        out[f"rms_norm/residual={residual}"] = (norm_rope._rms_norm_kernel, norm_ptrs, consts)
    rope_ptrs = {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    out["rope"] = (norm_rope._rope_kernel, rope_ptrs, {"X_BF16": True, "BLOCK_H": 32, "BLOCK_HALF": 64})
    for dtype in ("fp32", "bf16"):
        bf16 = dtype == "bf16"
        tiles = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}
        ptrs = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "act_ptr": f"*{dtype}", "pairs_ptr": "*i32",
                "experts_ptr": "*i32"}  # fmt: skip
        out[f"moe_gate_up/{dtype}"] = (moe._gate_up_kernel, ptrs, {"BF16": bf16, "BF16_DOT": bf16, **tiles})
        ptrs = {"act_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "route_ptr": "*fp32", "out_ptr": "*fp32",
                "pairs_ptr": "*i32", "experts_ptr": "*i32"}  # fmt: skip
        out[f"moe_down/{dtype}"] = (moe._down_kernel, ptrs, {"BF16_DOT": bf16, **tiles})
    return out


# Shared memory one block may take on sm_90 (H100 / H200: 227 KiB).
MAX_SHARED_BYTES = 232448


def compile_all(arch: int) -> dict[str, str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for name, (kernel, ptrs, consts) in variants().items():
        signature = {}
        for arg in kernel.arg_names:
            if arg in consts:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                signature[arg] = ptrs[arg]
            else:
                signature[arg] = "fp32" if arg in ("scale", "eps", "softcap") else "i32"
        try:
            compiled = triton.compile(ASTSource(kernel, signature, consts), target=GPUTarget("cuda", arch, 32))
            if not compiled.asm.get("cubin"):
                results[name] = "no cubin"
            elif compiled.metadata.shared > MAX_SHARED_BYTES:  # the launch would raise OutOfResources
                results[name] = f"shared memory {compiled.metadata.shared} B > {MAX_SHARED_BYTES} B"
            else:
                results[name] = "ok"
        except Exception as e:  # reported per variant, the test names them
            results[name] = f"{type(e).__name__}: {str(e)[-400:]}"
    return results


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run with TRITON_INTERPRET=0: the interpreter defines no compilable kernels")
    print(json.dumps(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
