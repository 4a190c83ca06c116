"""Build the vLLM 0.33 ops that its Marlin NVFP4 fused MoE calls, from vLLM's own source, for one sm90 GPU.

    python scripts/device_build_vllm_marlin_moe.py --src build/vllm-0.33.0 --out build/vllm-marlin-ops [--jobs 16]

``--src`` is vLLM 0.33.0's source tree, or just its ``csrc`` (fetched, never committed: ``build/`` is ignored; see
docs/verify.md for where it comes from). Built with ``torch.utils.cpp_extension`` against the torch that runs it,
as one library ``vllm_marlin_moe_ops.so``:

- ``_moe_C::moe_wna16_marlin_gemm``: csrc/moe/marlin_moe_wna16/ops.cu and the kernel template instances that
  ``fused_marlin_moe`` can pick for bf16 activations, FP4 (float4_e2m1f) weights and FP8 block scales (group of
  16, one 16x16 tile): M tiles 8, 16, 32, 48, 64 times the three thread tiles ops.cu tries for that M, 15 in all
  (vLLM's generator instantiates about 900 for every type it serves);
- ``_moe_C::moe_align_block_size`` and ``_moe_C::moe_sum``: csrc/moe/moe_align_sum_kernels.cu;
- ``_C::silu_and_mul``: csrc/activation_kernels.cu.

The op schemas are vLLM's (csrc/moe/torch_bindings.cpp, csrc/torch_bindings.cpp), registered through torch's stable
ABI at the version vLLM targets (2.11). Prints the library's path last; `fp4kit verify` loads it when
``FP4KIT_VLLM_MARLIN_OPS`` names it (fp4kit.verify.vllm_marlin).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import time
from pathlib import Path

NAME = "vllm_marlin_moe_ops"
KERNEL_DIR = Path("moe/marlin_moe_wna16")
# (thread_k, thread_n, threads): ops.cu's small-batch configs for one 16-row M block, large-batch ones above
SMALL_BATCH_TILES = ((128, 128, 256), (64, 128, 128), (128, 64, 128))
LARGE_BATCH_TILES = ((64, 256, 256), (64, 128, 128), (128, 64, 128))
M_BLOCK_SIZES = (8, 16, 32, 48, 64)  # fused_marlin_moe's moe_block_size choices
TYPES = ("vllm::kBFloat16", "vllm::kFE2M1f", "vllm::kBFloat16", "vllm::kFE4M3fn")  # a, b, c, scale
STAGES, GROUP_BLOCKS = 4, 1  # sm80+ pipeline depth; NVFP4 groups of 16 = one 16-wide tile

SCHEMAS = {
    "_moe_C": {
        "moe_sum": "moe_sum(Tensor input, Tensor! output, Tensor? topk_ids=None, Tensor? expert_map=None) -> ()",
        "moe_align_block_size": (
            "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, Tensor! sorted_token_ids, "
            "Tensor! experts_ids, Tensor! num_tokens_post_pad, Tensor? maybe_expert_map, "
            "Tensor(a!)? scatter_idx=None) -> ()"),
        "moe_wna16_marlin_gemm": (
            "moe_wna16_marlin_gemm(Tensor! a, Tensor? c_or_none, Tensor! b_q_weight, Tensor? b_bias_or_none, "
            "Tensor! b_scales, Tensor? a_scales, Tensor? global_scale, Tensor? b_zeros_or_none, Tensor! workspace, "
            "Tensor sorted_token_ids, Tensor! expert_ids, Tensor! num_tokens_past_padded, Tensor! topk_weights, "
            "int moe_block_size, int top_k, bool mul_topk_weights, int b_type_id, int size_m, int size_n, "
            "int size_k, bool use_atomic_add, bool use_fp32_reduce, bool is_zp_float, int thread_k, int thread_n, "
            "int blocks_per_sm) -> Tensor"),
    },
    "_C": {"silu_and_mul": "silu_and_mul(Tensor! result, Tensor input) -> ()"},
}
# implemented in the vLLM sources compiled here (moe_wna16_marlin_gemm registers its own CUDA kernel in ops.cu)
IMPLS = {"_moe_C": ("moe_sum", "moe_align_block_size"), "_C": ("silu_and_mul",)}


def kernel_instances() -> list[dict[str, object]]:
    instances = []
    for block in M_BLOCK_SIZES:
        m_blocks = max(1, block // 16)
        for thread_k, thread_n, threads in SMALL_BATCH_TILES if m_blocks == 1 else LARGE_BATCH_TILES:
            instances.append({"threads": threads, "m_blocks": m_blocks, "n_blocks": thread_n // 16,
                              "k_blocks": thread_k // 16, "m8": "true" if block == 8 else "false"})
    return instances


def template_arguments(k: dict[str, object]) -> str:
    ids = ", ".join(f"{t}.id()" for t in TYPES)
    return (f"{ids}, {k['threads']}, {k['m_blocks']}, {k['n_blocks']}, {k['k_blocks']}, {k['m8']}, {STAGES}, "
            f"{GROUP_BLOCKS}, false")


def write_kernels(kernel_dir: Path) -> list[Path]:
    """One .cu per template instance (they compile in parallel) and the ``kernel_selector.h`` ops.cu includes."""
    for old in itertools.chain(kernel_dir.glob("*kernel_*.cu"), kernel_dir.glob("kernel_selector.h")):
        old.unlink()
    sources, branches = [], []
    a, b, c, s = TYPES
    for n, k in enumerate(kernel_instances()):
        path = kernel_dir / f"fp4kit_kernel_{n:02d}.cu"
        path.write_text('#include "kernel.h"\n#include "marlin_template.h"\n\nnamespace MARLIN_NAMESPACE_NAME {\n'
                        f"template __global__ void Marlin<{template_arguments(k)}>(MARLIN_KERNEL_PARAMS);\n}}\n")
        sources.append(path)
        condition = " && ".join([f"a_type == {a}", f"b_type == {b}", f"c_type == {c}", f"s_type == {s}",
                                 f"threads == {k['threads']}", f"thread_m_blocks == {k['m_blocks']}",
                                 f"thread_n_blocks == {k['n_blocks']}", f"thread_k_blocks == {k['k_blocks']}",
                                 f"m_block_size_8 == {k['m8']}", f"stages == {STAGES}",
                                 f"group_blocks == {GROUP_BLOCKS}", "is_zp_float == false"])
        branches.append(f"{'else ' if branches else ''}if ({condition})\n  kernel = Marlin<{template_arguments(k)}>;")
    (kernel_dir / "kernel_selector.h").write_text("\n".join(branches) + "\n")
    return sources


def write_bindings(path: Path) -> Path:
    lines = ['#include <torch/csrc/stable/library.h>', '#include <torch/csrc/stable/tensor.h>', '',
             '#include "moe/moe_ops.h"', '',
             'void silu_and_mul(torch::stable::Tensor& out, torch::stable::Tensor& input);', '']
    for namespace, schemas in SCHEMAS.items():
        lines.append(f"STABLE_TORCH_LIBRARY_FRAGMENT({namespace}, m) {{")
        lines += [f'  m.def("{schema}");' for schema in schemas.values()]
        lines += ["}", "", f"STABLE_TORCH_LIBRARY_IMPL({namespace}, CUDA, m) {{"]
        lines += [f'  m.impl("{op}", TORCH_BOX(&{op}));' for op in IMPLS[namespace]]
        lines += ["}", ""]
    path.write_text("\n".join(lines))
    return path


def csrc_of(src: Path) -> Path:
    for candidate in (src / "csrc", src):
        if (candidate / KERNEL_DIR / "ops.cu").is_file():
            return candidate
    raise SystemExit(f"{src}: no vLLM csrc/{KERNEL_DIR}/ops.cu under it")


def build(src: Path, out: Path, jobs: int, verbose: bool) -> Path:
    import torch
    from torch.utils import cpp_extension

    out.mkdir(parents=True, exist_ok=True)
    csrc = out / "csrc"
    if csrc.exists():
        shutil.rmtree(csrc)
    shutil.copytree(csrc_of(src), csrc)  # the generated kernels go next to the kernel.h they include
    kernels = write_kernels(csrc / KERNEL_DIR)
    sources = [write_bindings(out / "bindings.cpp"), csrc / KERNEL_DIR / "ops.cu",
               csrc / "moe/moe_align_sum_kernels.cu", csrc / "activation_kernels.cu", *kernels]
    defines = ["-DUSE_CUDA", "-DTORCH_TARGET_VERSION=0x020B000000000000ULL", "-DENABLE_FP8"]
    # vLLM builds with torch's nvcc flags minus the ones that hide half/bf16 operators (cmake/utils.cmake)
    undefine = [f"-U{flag}" for flag in ("__CUDA_NO_HALF_OPERATORS__", "__CUDA_NO_HALF_CONVERSIONS__",
                                         "__CUDA_NO_BFLOAT16_CONVERSIONS__", "__CUDA_NO_HALF2_OPERATORS__")]
    cuda_flags = [*defines, *undefine, "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90",
                  "-static-global-template-stub=false", "--expt-relaxed-constexpr", "--expt-extended-lambda"]
    os.environ["MAX_JOBS"] = str(jobs)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    start = time.perf_counter()
    cpp_extension.load(name=NAME, sources=[str(s) for s in sources], extra_cflags=[*defines, "-O3", "-std=c++17"],
                       extra_cuda_cflags=cuda_flags, extra_include_paths=[str(csrc)], build_directory=str(out),
                       is_python_module=False, verbose=verbose)
    library = out / f"{NAME}.so"
    missing = [f"{ns}::{op}" for ns, ops in SCHEMAS.items() for op in ops if not hasattr(getattr(torch.ops, ns), op)]
    if missing:
        raise SystemExit(f"built {library} but it registers no {', '.join(missing)}")
    print(f"built {len(kernels)} Marlin kernel instances and {len(sources) - len(kernels)} other sources in "
          f"{time.perf_counter() - start:.0f} s (torch {torch.__version__}, sm90)")
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, required=True, help="vLLM 0.33.0 source tree or its csrc")
    parser.add_argument("--out", type=Path, required=True, help="build folder (ignored by git)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--list", action="store_true", help="print the kernel instances and exit")
    args = parser.parse_args()
    if args.list:
        for k in kernel_instances():
            print(template_arguments(k))
        return
    print(build(args.src, args.out, args.jobs, args.verbose))


if __name__ == "__main__":
    main()
