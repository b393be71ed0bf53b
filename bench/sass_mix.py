"""Instruction mix of a Triton kernel's hottest loop, compiled for the H200 (sm_90) on a machine
without a GPU: Triton's NVIDIA backend and the ptxas / nvdisasm its wheel ships run anywhere. A
way to compare kernel variants between device leases (what a change does to the per-element
instruction count), not a timing. Integer arguments marked divisible by 16 here, as Triton
specialises them at launch for 16-aligned strides, so loads vectorise as they would on the device.

Usage: python -m bench.sass_mix [grouped_gemm | kda_fused | mla_decode | mla_prefill] (all by default);
SASS_MIX_DUMP=dir also writes each grouped-GEMM row's TTGIR and SASS there.

Seventh session (RESULTS.md): the MXFP4 grouped GEMM's K loop (swapped 32-wide tile, BLOCK_K 128,
2 warps, gate and up) issues ~680 instructions a thread with tl.dot_scaled (5.3 a code) and ~780
with our PTX upcast (6.1 a code), the bf16 loop 81 for 64 weights (1.3 a weight); the KDA fused
decode went from 3,944 to 1,824 instructions a thread once v stopped being picked out of the
whole head by a masked reduction. Twelfth session: the MMA-layout upcast ("mx_mma") 3.8 a code at
128 wide, 4.6 at its tuned 64 wide (Triton 3.6). To read the device's compiler here, put Triton
3.6 first on PYTHONPATH (pip download triton==3.6.0; pip install --no-deps --target DIR): its
counts match the device's exactly.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget


def compile_sm90(fn, signature: dict, constexprs: dict, divisible: tuple[str, ...], **options):
    names = list(signature) + [k for k in constexprs if k not in signature]
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _cubin_tool(kernel, tool: str, *args: str) -> str:
    """Output of one of the CUDA binary tools shipped in Triton's wheel on the kernel's cubin."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
        return subprocess.run([exe, *args, path], capture_output=True, text=True, check=True).stdout


def sass_text(kernel) -> str:
    """The kernel's SASS (nvdisasm)."""
    return _cubin_tool(kernel, "nvdisasm", "-c")


def registers(kernel) -> int:
    """Registers a thread of the compiled kernel uses (cuobjdump): with the warps, how many
    programs an SM can hold."""
    return int(re.search(r"REG:(\d+)", _cubin_tool(kernel, "cuobjdump", "-res-usage")).group(1))


def _code_and_loops(kernel) -> tuple[list, list]:
    """The SASS as (address, instruction) pairs, and every backward-branch span (start, end)."""
    text = sass_text(kernel)
    code, labels, pending = [], {}, None
    for line in text.splitlines():
        line = line.strip()
        if m := re.match(r"(\.L_x_\d+):", line):
            pending = m.group(1)
        elif m := re.match(r"/\*([0-9a-f]+)\*/\s+(.*?);", line):
            addr = int(m.group(1), 16)
            code.append((addr, m.group(2)))
            if pending:
                labels[pending], pending = addr, None
    loops = []
    for addr, ins in code:
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ins)
        if m and labels.get(m.group(1), addr) < addr:
            loops.append((labels[m.group(1)], addr))
    return code, loops


def _span_mix(code: list, span: tuple[int, int]) -> collections.Counter:
    ops = collections.Counter()
    for addr, ins in code:
        if span[0] <= addr <= span[1]:
            words = ins.split()
            ops[(words[1] if words[0].startswith("@") else words[0]).split(".")[0]] += 1
    return ops


def hottest_loop_mix(kernel) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of the longest backward-branch span in the SASS: the main loop."""
    code, loops = _code_and_loops(kernel)
    ops = _span_mix(code, max(loops, key=lambda s: s[1] - s[0], default=(0, -1)))
    return sum(ops.values()), ops


def mma_loop_mixes(kernel) -> list[collections.Counter]:
    """Opcode counts of each loop that issues tensor-core MMAs, in code order: for kernels with several
    main loops, or with mbarrier waits whose retry blocks sit past the last EXIT and branch back into
    a loop (spans that are not loops, left out here)."""
    code, loops = _code_and_loops(kernel)
    last_exit = max((a for a, ins in code if re.match(r"(@\S+\s+)?EXIT", ins)), default=code[-1][0])
    mixes = [_span_mix(code, s) for s in sorted(loops) if s[1] < last_exit]
    return [ops for ops in mixes if ops["HGMMA"] or ops["HMMA"]]


def dump(kernel, name: str) -> None:
    """With SASS_MIX_DUMP=dir: the kernel's TTGIR and SASS into that folder (layouts, converts)."""
    folder = os.environ.get("SASS_MIX_DUMP")
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{name}.ttgir"), "w") as f:
            f.write(kernel.asm["ttgir"])
        with open(os.path.join(folder, f"{name}.sass"), "w") as f:
            f.write(sass_text(kernel))


def grouped_gemm_rows() -> None:
    from k3serve.ops import moe_triton

    ptrs = {"X": "*bf16", "W": "*u8", "S": "*u8", "W_UP": "*u8", "S_UP": "*u8", "OUT": "*bf16", "ROWS": "*i64",
            "EXPERTS": "*i64", "ROW_SCALE": "*fp32"}
    ints = {n: "i32" for n in ("num_assign", "rows_class", "top_k", "N", "K", "stride_xt", "stride_we", "stride_wn",
                               "stride_se", "stride_sn", "stride_on")}
    ints.update(beta="fp32", linear_beta="fp32", static_expert0="i32")
    divisible = tuple(ptrs) + ("N", "K", "stride_xt", "stride_we", "stride_wn", "stride_se", "stride_on")
    print("| grouped GEMM (gate + up, 16 rows) | tile (BLOCK_N, swap, BLOCK_K, warps, stages) | registers "
          "| loop instr / thread | per weight | top opcodes |\n|---|---|---|---|---|---|")
    for weights, bn, swap, bk, nw, st in (("mx_dot_scaled", 32, True, 128, 2, 4), ("mx_asm", 32, True, 128, 2, 4),
                                          ("mx_asm", 128, True, 128, 4, 3), ("mx_mma", 64, True, 128, 4, 2),
                                          ("mx_mma", 128, True, 128, 4, 3), ("bf16", 32, True, 64, 2, 4)):
        sig = dict(ptrs, W="*bf16", W_UP="*bf16", S="*bf16", S_UP="*bf16") if weights == "bf16" else ptrs
        consts = dict(WEIGHTS=weights, GLU=True, SITU=False, LINEAR_CLIP=False, HAS_ROW_SCALE=False, BLOCK_M=16,
                      BLOCK_N=bn, BLOCK_K=bk, SWAP_AB=swap, INTERPRETED=False, COLS_FIRST=False, USE_PDL=False,
                      STATIC_TAIL=0)
        kernel = compile_sm90(moe_triton._grouped_gemm_kernel, {**sig, **ints}, consts, divisible,
                              num_warps=nw, num_stages=st)
        total, ops = hottest_loop_mix(kernel)
        dump(kernel, f"grouped_gemm_{weights}_{bn}_{nw}")
        per = total / (2 * bn * bk / (32 * nw))  # gate and up tiles spread over the program's threads
        print(f"| {weights} | {bn}, {swap}, {bk}, {nw}, {st} | {registers(kernel)} | {total} | {per:.1f} | "
              f"{', '.join(f'{k} {v}' for k, v in ops.most_common(6))} |")


def kda_fused_rows() -> None:
    from k3serve.ops import kda_decode_triton

    f32, bf16 = "*fp32", "*bf16"
    ptrs = {"X": bf16, "CONV_W": f32, "CONV_STATE": bf16, "HAS_CTX": "*i32", "F": bf16, "BETA": bf16, "A_LOG": f32,
            "DT_BIAS": f32, "GATE": bf16, "ONORM_W": f32, "STATE": f32, "SLOTS": "*i64", "O_SCRATCH": f32,
            "SUMSQ": f32, "TICKETS": "*i32", "Y": bf16}
    ints = {n: "i32" for n in ("stride_conv_slot", "stride_state_slot", "stride_x", "stride_f", "stride_b", "stride_g")}
    ints.update(scale="fp32", lower_bound="fp32", eps="fp32", H="i32")
    divisible = tuple(ptrs) + tuple(ints)[:6]
    print("\n| KDA fused decode (D 128) | registers | instructions / thread | top opcodes |"
          "\n|---|---|---|---|")
    for bv, blocks, nw in ((64, 1, 4), (64, 2, 4), (32, 4, 4), (128, 1, 8)):
        consts = dict(D=128, W=4, BV=bv, BLOCKS=blocks, USE_LOWER_BOUND=True, ORDER=1, USE_PDL=False)
        kernel = compile_sm90(kda_decode_triton._kda_decode_fused_kernel, {**ptrs, **ints}, consts, divisible,
                              num_warps=nw)
        total, ops = whole_mix(kernel)
        print(f"| {128 // (bv * blocks)} programs a head, value block {bv}, {nw} warps | {registers(kernel)} | {total} | "
              f"{', '.join(f'{k} {v}' for k, v in ops.most_common(8))} |")


def mla_decode_rows() -> None:
    from k3serve.ops import mla_decode_triton

    ptrs = {"QC": "*bf16", "QP": "*bf16", "KV": "*bf16", "BT": "*i32", "SL": "*i32", "O": "*fp32", "LSE": "*fp32"}
    strides = ("stride_qb", "stride_qh", "stride_pb", "stride_ph", "stride_kvp", "stride_kvt", "stride_btb",
               "stride_btp", "stride_ob", "stride_oh", "stride_os", "stride_lb", "stride_lh")
    ints = dict({n: "i32" for n in strides}, scale="fp32", H="i32", NUM_SPLITS="i32", CTX_BUCKET="i32")
    divisible = tuple(ptrs) + tuple(n for n in strides if n not in ("stride_os", "stride_lh", "stride_btp"))
    print("\n| MLA split decode (64-token pages) | tile (BLOCK_H, BLOCK_N, warps, stages) | registers "
          "| loop instr / thread | per latent element (lanes) | top opcodes |\n|---|---|---|---|---|---|")
    for bh, bn, nw, st in ((16, 32, 4, 2), (16, 64, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2)):
        consts = dict(PAGE=64, D_C=512, D_PE=64, D_C_P=512, D_PE_P=64, BLOCK_H=bh, BLOCK_N=bn, USE_PDL=False)
        kernel = compile_sm90(mla_decode_triton._mla_decode_split_kernel, {**ptrs, **ints}, consts, divisible,
                              num_warps=nw, num_stages=st)
        total, ops = hottest_loop_mix(kernel)
        print(f"| {bh} heads | {bh}, {bn}, {nw}, {st} | {registers(kernel)} | {total} | {total * nw * 32 / (bn * 576):.1f} | "
              f"{', '.join(f'{k} {v}' for k, v in ops.most_common(6))} |")


def mla_prefill_rows() -> None:
    from k3serve.ops import mla_prefill_triton

    ptrs = {n: "*bf16" for n in ("Q", "KN", "KP", "V")} | {"O": "*fp32", "SEQS": "*i32"}
    strides = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_pt", "stride_vt", "stride_vh", "stride_ot",
               "stride_oh")
    ints = {"context_len": "i32", "Tq": "i32", "S": "i32", "scale": "fp32", "TQ_BUCKET": "i32"} | {
        n: "i32" for n in strides}
    print("\n| MLA flash prefill (kimi-linear: 32 heads, 128 + 64 / 128 wide, varlen) | tile (BLOCK_M, BLOCK_N, warps, "
          "stages) | registers | shared KB | loop instr / thread: below the diagonal, on it | CTA barriers a block "
          "| top opcodes (below) |\n|---|---|---|---|---|---|---|")
    for tma in (False, True):
        for bm, bn, nw, st in ((128, 64, 8, 3), (128, 128, 8, 2)):
            consts = dict(DN=128, DR=64, DV=128, DN_P=128, DR_P=64, DV_P=128, BLOCK_M=bm, BLOCK_N=bn, VARLEN=True,
                          TMA=tma, HEADS=32)
            kernel = compile_sm90(mla_prefill_triton._mla_prefill_kernel, {**ptrs, **ints}, consts,
                                  tuple(ptrs)[:5] + strides, num_warps=nw, num_stages=st)
            below, diagonal = mma_loop_mixes(kernel)
            print(f"| {'TMA' if tma else 'pointers (cp.async)'} | {bm}, {bn}, {nw}, {st} | {registers(kernel)} | "
                  f"{kernel.metadata.shared // 1024} | {sum(below.values())}, {sum(diagonal.values())} | {below['BAR']} "
                  f"| {', '.join(f'{k} {v}' for k, v in below.most_common(8))} |")


def whole_mix(kernel) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of the whole kernel (the KDA decode's value-block loop is unrolled)."""
    total, ops = hottest_loop_mix(kernel)
    if total:
        return total, ops
    for m in re.finditer(r"/\*[0-9a-f]+\*/\s+(@\S+\s+)?([A-Z0-9_]+)", sass_text(kernel)):
        ops[m.group(2)] += 1
    return sum(ops.values()), ops


def main() -> None:
    which = sys.argv[1:] or ["grouped_gemm", "kda_fused", "mla_decode", "mla_prefill"]
    if "grouped_gemm" in which:
        grouped_gemm_rows()
    if "kda_fused" in which:
        kda_fused_rows()
    if "mla_decode" in which:
        mla_decode_rows()
    if "mla_prefill" in which:
        mla_prefill_rows()


if __name__ == "__main__":
    main()
