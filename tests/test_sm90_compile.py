"""GPU-only kernel paths compiled for Hopper (sm_90) on this CPU machine: Triton's NVIDIA backend
and the ptxas it ships run without a GPU, so front-end errors and bad inline PTX in code the
interpreter cannot run (our E2M1 upcast, programmatic dependent launch) fail here, not on the
device. What they compute is checked on the GPU (bench/kernels_moe.py, bench/gpu_check_*)."""

import re

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
except ImportError:  # pragma: no cover - a Triton build without the NVIDIA backend
    pytest.skip("Triton's NVIDIA backend is not installed", allow_module_level=True)

from k3serve.ops import kda_decode_triton, moe_triton, norm_triton, short_conv_triton  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
JOINT_ROUNDS = 8  # the AttnRes program-a-token mixer's barrier rounds at 5 sources (Triton 3.6 and 3.9)


def _compile(fn, pointers: dict, scalars: dict, consts: dict, divisible: tuple[str, ...] = (), **options):
    """``divisible``: arguments marked 16-divisible, as Triton specialises them at launch for
    16-aligned pointers and strides (vector loads, and the layouts that follow from them)."""
    sig = {**pointers, **{n: t for n, t in scalars.items()}, **{k: "constexpr" for k in consts}}
    names = list(fn.arg_names)  # (the attributes name arguments by their place in the kernel's signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=HOPPER, options=options)


def _grouped_gemm(weights: str, block_n: int, warps: int, swap: bool = True, use_pdl: bool = False,
                  static_tail: int = 0):
    """The grouped GEMM (MXFP4, or bf16 for ``weights`` "bf16", gate + up with SiTU-GLU, 16-row
    blocks, K tiles of 128) for sm_90."""
    w = "*bf16" if weights == "bf16" else "*u8"
    ptrs = {"X": "*bf16", "W": w, "S": w, "W_UP": w, "S_UP": w, "OUT": "*bf16", "ROWS": "*i64",
            "EXPERTS": "*i64", "ROW_SCALE": "*fp32"}
    ints = {n: "i32" for n in ("num_assign", "rows_class", "top_k", "N", "K", "stride_xt", "stride_we", "stride_wn",
                               "stride_se", "stride_sn", "stride_on")}
    ints.update(beta="fp32", linear_beta="fp32", static_expert0="i32")
    consts = dict(WEIGHTS=weights, GLU=True, SITU=True, LINEAR_CLIP=True, HAS_ROW_SCALE=False, BLOCK_M=16,
                  BLOCK_N=block_n, BLOCK_K=128, SWAP_AB=swap, INTERPRETED=False, COLS_FIRST=False,
                  STATIC_TAIL=static_tail, USE_PDL=use_pdl)
    divisible = tuple(ptrs) + ("N", "K", "stride_xt", "stride_we", "stride_wn", "stride_se", "stride_on")
    return _compile(moe_triton._grouped_gemm_kernel, ptrs, ints, consts, divisible, num_warps=warps, num_stages=3)


def test_static_tail_grouped_gemm_waits_only_to_store():
    """A one-token step's joined shared expert (STATIC_TAIL): its blocks let the next kernel launch,
    stream and multiply before the PDL wait, then wait to store; the routed blocks wait first."""
    ptx = _grouped_gemm("bf16", 64, 4, True, use_pdl=True, static_tail=1).asm["ptx"]
    assert ptx.count("griddepcontrol.wait") == 2 and ptx.count("griddepcontrol.launch_dependents") == 2
    plain = _grouped_gemm("bf16", 64, 4, True, use_pdl=True).asm["ptx"]
    assert plain.count("griddepcontrol.wait") == 1
    first_wait = plain.find("griddepcontrol.wait")
    assert "ld.global" not in plain[:first_wait]


@pytest.mark.parametrize("swap, block_n, warps", [(True, 32, 2), (False, 64, 4)])
def test_mxfp4_asm_upcast_grouped_gemm_compiles_for_sm90(swap, block_n, warps):
    kernel = _grouped_gemm("mx_asm", block_n, warps, swap, use_pdl=True)
    ptx = kernel.asm["ptx"]
    assert "mul.rn.bf16x2" in ptx and "prmt.b32" in ptx  # our upcast made it into the kernel
    assert "griddepcontrol.wait" in ptx and kernel.asm["cubin"]


@pytest.mark.parametrize("block_n, warps", [(128, 4), (64, 4), (128, 8)])
def test_mxfp4_mma_layout_grouped_gemm_keeps_weights_in_registers(block_n, warps):
    """The MMA-layout upcast's weight tile goes from its load to the MMA in registers: no
    value-carrying shared-memory allocation of it (the round trip Triton 3.6 made when the block
    scale was folded into the upcast, twelfth session: that variant fails here under 3.6, not
    under 3.9). The device runs 3.6: ``pip install --no-deps --target DIR triton==3.6.0`` and
    ``PYTHONPATH=DIR pytest tests/test_sm90_compile.py`` checks against its compiler on CPU."""
    kernel = _grouped_gemm("mx_mma", block_n, warps)
    ttgir = kernel.asm["ttgir"]
    assert "warp_group_dot" in ttgir or "tt.dot" in ttgir
    # the activation tile [16, 32] goes to shared memory (the MMA's other operand); the weight tile not
    assert not re.search(rf"local_alloc %\S+ : \(tensor<{block_n}x32xbf16", ttgir)
    assert "mul.rn.bf16x2" in kernel.asm["ptx"] and kernel.asm["cubin"]


def _gluon_grouped_gemm(glu: bool, block_m: int, warps: int, split_k: int = 1, **pdl_consts):
    """moe_gluon's kernel compiled for sm_90 (``pdl_consts``: USE_PDL, PREFETCH, STATIC_TAIL, and the
    served ACC_STORE / EARLY_ROWS overridden)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from k3serve.ops import moe_gluon

    ptrs = {"X": "*bf16", "W": "*u8", "S": "*u8", "W_UP": "*u8", "S_UP": "*u8",
            "OUT": "*fp32" if split_k > 1 else "*bf16", "ROWS": "*i64",
            "EXPERTS": "*i64", "ROW_SCALE": "*fp32"}
    ints = {n: "i32" for n in ("num_assign", "top_k", "N", "K", "stride_xt", "stride_we", "stride_wn", "stride_se",
                               "stride_sn", "stride_on")}
    ints.update(beta="fp32", linear_beta="fp32", static_expert0="i32")
    consts = dict(GLU=glu, SITU=True, LINEAR_CLIP=True, HAS_ROW_SCALE=not glu, BLOCK_M=block_m,
                  WARPS=warps, COLS_FIRST=block_m >= 64, SPLIT_K=split_k,
                  **{"USE_PDL": False, "PREFETCH": False, "STATIC_TAIL": 0, "ACC_STORE": moe_gluon.ACC_STORE,
                     "EARLY_ROWS": moe_gluon.EARLY_ROWS, **pdl_consts})
    sig = {**ptrs, **ints, **{k: "constexpr" for k in consts}}
    names = list(sig)
    divisible = tuple(ptrs) + ("N", "K", "stride_xt", "stride_we", "stride_wn", "stride_se", "stride_on")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = GluonASTSource(fn=moe_gluon._grouped_gemm_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=HOPPER, options=dict(num_warps=warps))


@pytest.mark.parametrize("glu, block_m, warps, split_k", [
    (True, 16, 4, 1), (False, 64, 4, 1), (True, 64, 4, 1), (False, 128, 4, 1), (True, 8, 4, 1), (True, 128, 8, 1),
    (False, 128, 8, 1), (True, 64, 8, 1), (True, 8, 4, 6), (False, 8, 4, 2)])
def test_gluon_mxfp4_grouped_gemm_compiles_with_wgmma_in_flight(glu, block_m, warps, split_k):
    """moe_gluon's kernel compiles for sm_90 (every layout conversion it asserts trivial is: the
    compile fails otherwise) and ptxas keeps wgmma groups in flight: a wait that leaves one or two
    outstanding, not every wait at zero (its serialisation, C7515), at decode and prefill row
    blocks, in the 8-warp STACKED form (one chain of 128 weight rows) and split over K (decode steps
    of few programs: fp32 partials, gate and up apart), nothing spilled; and the K loop takes one
    CTA barrier a step (the slots of its double buffer are allocations of their own, so the compiler
    adds none around the copies: it put three a step when they were one ring indexed at run time),
    and its upcast costs ~9 integer instructions a word of 8 codes (``mxfp4.MMA_PAIR_TERMS``; 11 in
    the layout before), i.e. under 2.4 LOP3 / SHF / IMAD.SHL for each of its 4 multiplies, the
    steps' address arithmetic included (2.27-2.33 in every form under Triton 3.6 and 3.9).
    What it computes is checked on the GPU (bench/gpu_check_kernels.py)."""
    from bench.sass_mix import sass_text

    sass = sass_text(_gluon_grouped_gemm(glu, block_m, warps, split_k))
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
    assert waits and set(waits) - {"0x0"}, waits
    assert "STL" not in sass
    steps = sass[sass.index("DEPBAR.LE SB0"):sass.rindex("HGMMA")]  # from the first step's copy wait to the last MMA
    if warps == 4 or triton.__version__.startswith("3.6"):  # (3.9 adds one after each 8-warp wgmma pair; the
        # device's 3.6 does not)
        assert steps.count("BAR.SYNC") == steps.count("DEPBAR.LE SB0") == 3, (steps.count("BAR.SYNC"),
                                                                               steps.count("DEPBAR.LE SB0"))
    integer = sum(len(re.findall(op, steps)) for op in (r"\bLOP3\.", r"\bSHF\.", r"\bIMAD\.SHL\."))
    assert integer < 2.4 * steps.count("HMUL2"), (integer, steps.count("HMUL2"))


@pytest.mark.parametrize("glu, split_k", [(True, 6), (False, 2), (True, 1), (False, 1)])
def test_gluon_grouped_gemm_loads_its_rows_at_once_and_stores_partials_from_the_accumulator(glu, split_k):
    """A program's expert id, its rows and its first row (the padding test) are loaded together,
    before the test's exit, so the first copies wait for one load's latency after the PDL wait,
    not two (EARLY_ROWS: the compiler sank the others behind the exit before); and split fp32
    partials are stored straight from the wgmma accumulator's registers: no shared-memory
    transposition after the last MMA (ACC_STORE; the bf16 rows keep theirs: 8-byte stores)."""
    from bench.sass_mix import sass_text

    def parts(**flags):
        sass = sass_text(_gluon_grouped_gemm(glu, 8, 4, split_k, USE_PDL=True, **flags))
        head = sass[:sass.index(" EXIT")]  # (not PREEXIT, the PDL launch of dependents)
        tail = sass[sass.rindex("HGMMA"):]
        return head.count("LDG.E"), tail.count("STS") + tail.count("LDS"), tail.count("BAR.SYNC")

    early, late = parts(EARLY_ROWS=True, ACC_STORE=True), parts(EARLY_ROWS=False, ACC_STORE=False)
    assert early[0] == 3 and late[0] == 1, (early, late)
    if split_k > 1:
        assert early[1] == 0 < late[1] and early[2] < late[2], (early, late)
    else:
        assert early[1:] == late[1:] and early[1] > 0, (early, late)


def _copies_before_a_wait(ptx: str) -> int:
    """The cp.async copies in the PTX text before its first PDL wait (the entry block falls through
    to the main path; the padding-only blocks' own wait is laid out after it or in a block apart)."""
    return len(re.findall(r"cp\.async\.c[ag]\.", ptx.split("griddepcontrol.wait")[0]))


@pytest.mark.parametrize("glu, split_k", [(False, 1), (False, 2), (True, 6)])
def test_gluon_grouped_gemm_in_the_pdl_chain(glu, split_k):
    """In the PDL chain every program waits (the next kernel's wait then covers the ones before):
    plainly at once, before any copy; with PREFETCH (the down GEMM) after the first step's weight
    and scale copies, the activations' after; with STATIC_TAIL (a one-token step's joined shared
    expert) the tail's programs let the next kernel launch, copy and multiply first and wait to store."""
    plain = _gluon_grouped_gemm(glu, 8, 4, split_k, USE_PDL=True).asm["ptx"]
    assert _copies_before_a_wait(plain) == 0 and plain.count("griddepcontrol.wait") == 1
    early = _gluon_grouped_gemm(glu, 8, 4, split_k, USE_PDL=True, PREFETCH=True).asm["ptx"]
    weights = 4 * (2 if glu else 1) + 1  # (a step: GROUPS weight copies of gate and up, one of the scales)
    assert _copies_before_a_wait(early) == weights
    assert early.count("griddepcontrol.wait") == 2  # (and the row blocks of padding only)
    tail = _gluon_grouped_gemm(glu, 8, 4, split_k, USE_PDL=True, STATIC_TAIL=1).asm["ptx"]
    assert tail.count("griddepcontrol.wait") == 3 and tail.count("griddepcontrol.launch_dependents") == 2
    assert "griddepcontrol" not in _gluon_grouped_gemm(glu, 8, 4, split_k, PREFETCH=True, STATIC_TAIL=1).asm["ptx"]


def test_gluon_kda_decode_compiles_with_warp_local_reductions():
    """kda_decode_gluon's program a head compiles for sm_90 (its layout conversions and shared
    views legal); its state copies are 16 bytes wide; and the two reductions over key rows of a
    pass stay within a warp: halving the pass width (two more passes) adds at most the one
    barrier a pass for its outputs, where rows reduced across warps would add two a reduction.
    What it computes is checked on the GPU (bench/gpu_check_kernels.py)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench.sass_mix import sass_text
    from k3serve.ops import kda_decode_gluon

    f32, bf16 = "*fp32", "*bf16"
    ptrs = {"X": bf16, "CONV_W": f32, "CONV_STATE": bf16, "HAS_CTX": "*i32", "F": bf16, "BETA": bf16, "A_LOG": f32,
            "DT_BIAS": f32, "GATE": bf16, "ONORM_W": f32, "STATE": f32, "SLOTS": "*i64", "Y": bf16}
    scalars = {n: "i32" for n in ("stride_conv_slot", "stride_state_slot", "stride_x", "stride_f", "stride_b",
                                  "stride_g")}
    scalars.update(scale="fp32", lower_bound="fp32", eps="fp32", H="i32")

    def sass(pass_cols: int) -> str:
        consts = dict(D=128, W=4, USE_LOWER_BOUND=True, PASS=pass_cols, HEADS_FASTEST=True, NUM_WARPS=4)
        sig = {**ptrs, **scalars, **{k: "constexpr" for k in consts}}
        names = list(sig)
        divisible = tuple(ptrs) + ("stride_conv_slot", "stride_state_slot", "stride_x", "stride_f", "stride_g")
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
        src = GluonASTSource(fn=kda_decode_gluon._kda_decode_fused_kernel, signature=sig, constexprs=consts,
                             attrs=attrs)
        return sass_text(triton.compile(src, target=HOPPER, options=dict(num_warps=4)))

    wide, narrow = sass(64), sass(32)
    assert re.search(r"LDGSTS\.E(\.BYPASS)?\.128", wide), "state copies not 16 bytes wide"
    assert narrow.count("BAR.SYNC") - wide.count("BAR.SYNC") <= 2


# mla_decode_gluon's two split steps: kernel, constexprs, warps, wgmmas a warp a 64-key tile by shape
MLA_GLUON_FORMS = {
    # keys-major: scores^T 32 for the 512 latent columns and 4 for the rotary part, then 8 x 4 for out^T
    "keys-major": ("_mla_decode_split_kernel", dict(BLOCK_H=32), 4, {"64x32x16": 32 + 4 + 8 * 4}),
    # heads-major: each warpgroup 32 keys of the scores (32 + 4), then its 256 columns of out (4)
    "heads-major": ("_mla_decode_heads_kernel", {}, 8, {"64x32x16": 32 + 4, "64x256x16": 4}),
    # seesaw: two partitions of a warpgroup, each the scores of its tile (32 + 4) and two products
    # of its 256 columns (4 + 4); counted over both partitions' code
    "seesaw": ("_mla_decode_seesaw_kernel", dict(KV_DESC=None, TMA=False), 4,
               {"64x64x16": 2 * (32 + 4), "64x256x16": 2 * (4 + 4)}),
    # the same with the ring's pages copied by TMA from a producer warp (KV_DESC a tensor descriptor)
    "seesaw, tma": ("_mla_decode_seesaw_kernel", dict(TMA=True), 4, {"64x64x16": 2 * (32 + 4), "64x256x16": 2 * (4 + 4)}),
}


@pytest.mark.parametrize("form", sorted(MLA_GLUON_FORMS))
@pytest.mark.parametrize("seq_len_type", ["*i32", "*i64"])
def test_gluon_mla_decode_compiles_on_wgmma(seq_len_type, form):
    """mla_decode_gluon's split steps compile for sm_90: the scores and the output on wgmma of the
    shapes each form is written for, the key tiles by 16-byte cp.async, nothing spilled, PDL's
    wait first. What they compute is checked on the GPU (bench/gpu_check_kernels.py)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench.sass_mix import sass_text
    from k3serve.ops import mla_decode_gluon

    ptrs = {"QC": "*bf16", "QP": "*bf16", "KV": "*bf16", "BT": "*i32", "SL": seq_len_type, "O": "*fp32", "LSE": "*fp32"}
    ints = {n: "i32" for n in ("stride_qb", "stride_qh", "stride_pb", "stride_ph", "stride_kvp", "stride_btb",
                               "stride_btp", "stride_ob", "stride_oh", "stride_os", "stride_lb", "stride_lh")}
    ints.update(scale="fp32", H="i32", NUM_SPLITS="i32")
    kernel, form_consts, warps, wgmmas = MLA_GLUON_FORMS[form]
    # (both launch orders, one a seq_lens type)
    consts = dict(PAGE=64, **form_consts, USE_PDL=True, HEAD_BLOCKS_FIRST=seq_len_type == "*i64")
    sig = {**ptrs, **ints, **{k: "constexpr" for k in consts}}
    if form == "seesaw, tma":
        box = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
        sig = {**ptrs, **ints, **{k: "constexpr" for k in consts if k != "TMA"},
               "KV_DESC": f"tensordesc<bf16[64, 64],{box!r}>", "TMA": "constexpr"}
    names = list(sig)
    divisible = tuple(ptrs) + ("stride_qb", "stride_qh", "stride_pb", "stride_ph", "stride_kvp", "stride_ob",
                               "stride_oh", "stride_os")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = GluonASTSource(fn=getattr(mla_decode_gluon, kernel), signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=HOPPER, options=dict(num_warps=warps))
    sass = sass_text(compiled)
    assert {shape: len(re.findall(r"HGMMA\.%s\b" % shape, sass)) for shape in wgmmas} == wgmmas
    # (the seesaw step spills a few wgmma descriptors under Triton 3.9; none under 3.6, which the device runs)
    spills_allowed = form.startswith("seesaw") and not triton.__version__.startswith("3.6")
    assert "STL" not in sass or spills_allowed
    ptx = compiled.asm["ptx"]  # in the decode step's PDL chain: nothing read before the wait
    if form == "seesaw, tma":  # the producer's 4 shares a round: 4 x 4 latent boxes and 2 rotary ones, no cp.async
        assert "setmaxnreg" in ptx and "LDGSTS" not in sass
        assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::(cta|cluster)\.global", ptx)) == 18
    else:
        assert re.search(r"LDGSTS\.E(\.BYPASS)?\.128", sass)
    if form == "seesaw":  # warp-specialised; each warpgroup's refills (2 before the loop, 2 in it) on mbarriers
        assert "setmaxnreg" in ptx and ptx.count("cp.async.mbarrier.arrive.noinc") == 8
    wait = ptx.find("griddepcontrol.wait")
    assert 0 <= wait < ptx.find("ld.global") and "griddepcontrol.launch_dependents" in ptx


def _add_rms_norm_ptx(use_pdl: bool, rows: int = 1, block: int = 4096, warps: int = 8) -> str:
    return _compile(norm_triton._add_rms_norm_kernel,
                    {"H": "*bf16", "DELTA": "*bf16", "W": "*bf16", "H_OUT": "*bf16", "Y": "*bf16"},
                    {n: "i32" for n in ("n_rows", "stride_h", "stride_d", "stride_ho", "stride_y", "D")} | {"eps": "fp32"},
                    dict(ROWS=rows, BLOCK=block, USE_PDL=use_pdl), num_warps=warps).asm["ptx"]


@pytest.mark.parametrize("rows, block, warps", [(1, 4096, 8), (32, 128, 4)])  # a row a program, and a tile of rows
def test_pdl_kernels_wait_before_touching_memory(rows, block, warps):
    ptx = _add_rms_norm_ptx(True, rows, block, warps)
    first_memory_op = min(ptx.find(op) for op in ("ld.global", "st.global") if op in ptx)
    assert 0 <= ptx.find("griddepcontrol.wait") < first_memory_op
    assert "griddepcontrol" not in _add_rms_norm_ptx(False, rows, block, warps)


# The fused KDA decode kernel's arguments: pointers, then the strides (16-divisible at launch) and scalars.
KDA_FUSED_PTRS = {"X": "*bf16", "CONV_W": "*fp32", "CONV_STATE": "*bf16", "HAS_CTX": "*i32", "F": "*bf16",
                  "BETA": "*bf16", "A_LOG": "*fp32", "DT_BIAS": "*fp32", "GATE": "*bf16", "ONORM_W": "*fp32",
                  "STATE": "*fp32", "SLOTS": "*i64", "O_SCRATCH": "*fp32", "SUMSQ": "*fp32", "TICKETS": "*i32",
                  "Y": "*bf16"}
KDA_FUSED_SCALARS = {**{n: "i32" for n in ("stride_conv_slot", "stride_state_slot", "stride_x", "stride_f", "stride_b",
                                           "stride_g")}, "scale": "fp32", "lower_bound": "fp32", "eps": "fp32", "H": "i32"}


@pytest.mark.parametrize("block_v, blocks", [(64, 1), (64, 2), (128, 1)])
def test_kda_fused_decode_compiles_for_sm90(block_v, blocks):
    """Value blocks as programs: the head's last program is elected by an acquire-release ticket
    (one per CTA, after a barrier) and reads the other blocks' outputs from L2."""
    consts = dict(D=128, W=4, BV=block_v, BLOCKS=blocks, USE_LOWER_BOUND=True, ORDER=1, USE_PDL=True)
    ptx = _compile(kda_decode_triton._kda_decode_fused_kernel, KDA_FUSED_PTRS, KDA_FUSED_SCALARS, consts,
                   num_warps=4).asm["ptx"]
    assert "griddepcontrol.wait" in ptx
    if block_v * blocks < 128:
        assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx
    else:  # one program per head: no ticket
        assert "atom." not in ptx
    wait = ptx.find("griddepcontrol.wait")
    assert "ld.global" not in ptx[:wait] and "st.global" not in ptx[:wait]


def test_kda_fused_decode_head_program_fits_three_an_sm_unspilled():
    """A program a head under ``HEAD_MAXNREG``: at most 168 registers a thread (three 4-warp
    programs an SM; 177 uncapped under Triton 3.6 ran at 71 / 73 % of copy instead of 82 / 86 %)
    and nothing spilled; its loads all issued before its first store (the q / k / v conv windows,
    the gates and the output gate: a store waits for its data, so a load written after it waits a
    round trip)."""
    from bench.sass_mix import compile_sm90, registers, sass_text

    consts = dict(D=128, W=4, BV=64, BLOCKS=2, USE_LOWER_BOUND=True, ORDER=1, USE_PDL=False)
    kernel = compile_sm90(kda_decode_triton._kda_decode_fused_kernel, {**KDA_FUSED_PTRS, **KDA_FUSED_SCALARS}, consts,
                          tuple(KDA_FUSED_PTRS) + tuple(KDA_FUSED_SCALARS)[:6], num_warps=4,
                          maxnreg=kda_decode_triton.HEAD_MAXNREG)
    sass = sass_text(kernel)
    assert registers(kernel) <= 168 and "STL" not in sass
    ptx = kernel.asm["ptx"]
    first_store = ptx.find("st.global")
    # before it: the slot and context flag, the q and k windows (x, old, shifted, weights), the gates
    # and the output gate: 28 loads in the PTX of Triton 3.6 and 3.9; 12 when q's conv state was
    # written before k's loads
    assert ptx[:first_store].count("ld.global") >= 24, ptx[:first_store].count("ld.global")


def test_mla_split_merge_compiles_for_sm90():
    from k3serve.ops import mla_decode_triton

    args = {"PARTIAL": "*fp32", "LSE": "*fp32", "OUT": "*fp32"} | {
        n: "i32" for n in ("S", "stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh", "stride_ob",
                           "stride_oh", "C")}
    ptx = _compile(mla_decode_triton._merge_splits_kernel, args, {}, dict(S_P=64, BLOCK_C=128, USE_PDL=True),
                   num_warps=4).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert 0 <= wait < ptx.find("ld.global")


def test_router_logits_kernel_compiles_for_sm90():
    ptrs = {"X": "*bf16", "W": "*bf16", "OUT": "*fp32"}
    scalars = {n: "i32" for n in ("T", "E", "D", "stride_x")}
    consts = dict(BLOCK_T=16, BLOCK_E=32, BLOCK_D=128, BF16_MMA=True, PRELOAD=False, USE_PDL=True)
    ptx = _compile(moe_triton._router_logits_kernel, ptrs, scalars, consts, num_warps=4).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "atom." not in ptx
    assert "ld.global" not in ptx[:ptx.find("griddepcontrol.wait")]
    # PRELOAD: the weight tile's loads before the wait, x's after it
    ptx = _compile(moe_triton._router_logits_kernel, ptrs, scalars, {**consts, "PRELOAD": True},
                   num_warps=4).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert 0 <= ptx.find("ld.global") < wait and "ld.global" in ptx[wait:] and "st.global" not in ptx[:wait]


def test_add_norm_router_kernel_reads_only_the_weights_before_the_wait():
    ptrs = {"H": "*bf16", "DELTA": "*bf16", "NORM_W": "*bf16", "W": "*bf16", "H_OUT": "*bf16", "Y": "*bf16",
            "OUT": "*fp32"}
    scalars = {**{n: "i32" for n in ("T", "E", "D", "stride_h", "stride_d", "stride_ho", "stride_y")}, "eps": "fp32"}
    consts = dict(BLOCK=4096, BLOCK_E=32, BLOCK_D=128, USE_PDL=True)
    ptx = _compile(moe_triton._add_norm_router_kernel, ptrs, scalars, consts, num_warps=8).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert 0 <= ptx.find("ld.global") < wait and "ld.global" in ptx[wait:] and "st.global" not in ptx[:wait]


@pytest.mark.parametrize("static_parts", [0, 18])
def test_route_kernel_compiles_for_sm90(static_parts):
    """The routing; ``static_parts``: its partial sums' loop unrolled (each part's loads in the code
    once: ptxas may then issue them all before the sum needs them); top-k by one int64 max a round
    (64-bit shuffles), the winners' scores gathered after the rounds."""
    ptrs = {"LOGITS": "*fp32", "BIAS": "*fp32", "W_OUT": "*fp32", "ID_OUT": "*i64"}
    scalars = {n: "i32" for n in ("num_parts", "stride_part", "stride_l", "E")} | {"scaling": "fp32"}
    consts = dict(K=8, K_P=8, E_P=256, HAS_BIAS=True, RENORM=True, SIGMOID=True, NUM_SHARED=1,
                  STATIC_PARTS=static_parts, USE_PDL=True)
    ptx = _compile(moe_triton._route_kernel, ptrs, scalars, consts, num_warps=1).asm["ptx"]
    assert "shfl.sync.bfly.b32" in ptx and "max.s64" in ptx
    loads = len(re.findall(r"ld\.global", ptx))  # (a part's 256 logits: 8 loads a lane of one warp)
    assert loads >= 8 * static_parts and (static_parts or loads < 8 * 4)


@pytest.mark.parametrize("sizes", [(64,), (16, 32, 64, 128)])
def test_expert_sort_kernels_compile_for_sm90(sizes):
    """expert_sort's two launches (prefill's sort by expert), one and four row-block sizes: PDL's
    wait first, the last program's ticket an acquire-release atomic; and decode's one-program sort."""
    from k3serve.ops import expert_sort

    s = list(sizes) + [1] * (4 - len(sizes))
    ptrs = {"IDS": "*i64", "COUNTS": "*i32", "TICKETS": "*i32", "ROWS": "*i64", "STARTS": "*i32", "FULL": "*i32",
            "TAIL": "*i32", "BE": "*i64"}
    scalars = {n: "i32" for n in ("num_assign", "num_experts", "rows_total", "nb0", "nb1", "nb2", "nb3", "boff1",
                                  "boff2", "boff3")}
    consts = dict(E_P=1024, NUM=len(sizes), S0=s[0], S1=s[1], S2=s[2], S3=s[3], BLOCK_A=1024, BLOCK_R=1024,
                  USE_PDL=True)
    ptx = _compile(expert_sort._expert_count_kernel, ptrs, scalars, consts, num_warps=4).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx) and "ld.global.cg" in ptx
    ptrs = {"IDS": "*i64", "COUNTS": "*i32", "CURSOR": "*i32", "TICKETS": "*i32", "ROWS": "*i64", "STARTS": "*i32",
            "FULL": "*i32", "TAIL": "*i32"}
    scalars = {n: "i32" for n in ("num_assign", "num_experts", "roff1", "roff2", "roff3")}
    consts = dict(E_P=1024, NUM=len(sizes), BLOCK_A=1024, USE_PDL=True)
    ptx = _compile(expert_sort._expert_place_kernel, ptrs, scalars, consts, num_warps=4).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)
    ptrs = {"IDS": "*i64", "ROWS": "*i64", "BLOCK_EXPERT": "*i64", "CURSOR": "*i32"}  # decode's one-program sort
    scalars = {n: "i32" for n in ("num_assign", "num_experts", "total_rows")}
    consts = dict(E_P=1024, BLOCK_M=sizes[0], BLOCK_A=512, BLOCK_R=1024, USE_PDL=True)
    assert "griddepcontrol.wait" in _compile(expert_sort._align_by_expert_kernel, ptrs, scalars, consts,
                                             num_warps=4).asm["ptx"]


@pytest.mark.parametrize("varlen, tma", [(False, False), (True, False), (True, True)])
def test_mla_prefill_compiles_for_sm90(varlen, tma):
    """The flash MLA prefill, one sequence or many in one launch (``mla_prefill_varlen``), keys and
    values by pointers or by TMA (``TMA_LOADS``: descriptors made in the kernel, loads by
    ``cp.async.bulk.tensor``)."""
    from k3serve.ops import mla_prefill_triton

    ptrs = {n: "*bf16" for n in ("Q", "KN", "KP", "V")} | {"O": "*fp32", "SEQS": "*i32"}
    scalars = {"context_len": "i32", "Tq": "i32", "S": "i32", "scale": "fp32", "TQ_BUCKET": "i32"} | {
        n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_pt", "stride_vt", "stride_vh",
                           "stride_ot", "stride_oh")}
    consts = dict(DN=128, DR=64, DV=128, DN_P=128, DR_P=64, DV_P=128, BLOCK_M=128, BLOCK_N=64, VARLEN=varlen,
                  TMA=tma, HEADS=32)
    kernel = _compile(mla_prefill_triton._mla_prefill_kernel, ptrs, scalars, consts, num_warps=8, num_stages=3)
    assert kernel.asm["cubin"]
    assert ("cp.async.bulk.tensor" in kernel.asm["ptx"]) == tma


def test_multi_row_gated_norm_compiles_for_sm90():
    """KDA's gated output norm, 16 rows of 128 a program (prefill), as the GPU compiles it; its
    vector loads follow from 16-aligned rows."""
    kernel = _compile(norm_triton._rms_norm_kernel, {"X": "*bf16", "W": "*fp32", "GATE": "*bf16", "Y": "*bf16"},
                      {n: "i32" for n in ("n_rows", "stride_x", "stride_y", "stride_g", "heads", "D")} | {"eps": "fp32"},
                      dict(HAS_WEIGHT=True, HAS_GATE=True, ROWS=16, BLOCK=128, USE_PDL=True),
                      ("X", "W", "GATE", "Y", "stride_x", "stride_y", "stride_g", "D"), num_warps=4)
    assert kernel.asm["cubin"] and re.search(r"ld\.global(\.\w+)*\.v[24]", kernel.asm["ptx"])


@pytest.mark.parametrize("channels_first, norm, head, block_c, fast_silu", [
    (False, False, 512, 512, False), (True, False, 1024, 1024, True), (True, True, 128, 512, True),
    (True, True, 48, 64, True)])
def test_short_conv_compiles_for_sm90(channels_first, norm, head, block_c, fast_silu):
    """The prefill short conv's two kernels, with channel-block-first program order, q/k L2 norm
    (4 heads of 128 a tile; a 48-wide head in 64 lanes: the bundled tiny model) and SiLU's
    approximate exp and division (libdevice, which the interpreter lacks). x's rows are 16-aligned
    (the fused in_proj's), so the stencil's loads and stores are vectors, and it never touches the
    conv state: no scalar (16-bit) global access at all. The norm's per-tile choice is a select:
    as a branch, the two sides' layouts met through shared memory (twice the instructions)."""
    ptrs = {"X": "*bf16", "WEIGHT": "*fp32", "OUT": "*bf16"}
    ints = {n: "i32" for n in ("T", "C", "PLANE", "stride_xt", "stride_op", "stride_ot")} | {"NORM_C": "i32",
                                                                                          "NORM_EPS": "fp32"}
    hp = triton.next_power_of_2(head)
    consts = dict(W=4, SILU=True, ROWS=8, GROUP=4, BLOCK_C=block_c, HEAD=head, HEAD_P=hp, CHANNELS_FIRST=channels_first,
                  NORM_HEADS=norm, FAST_SILU=fast_silu)
    divisible = ("X", "OUT", "C", "PLANE", "stride_xt", "stride_op", "stride_ot")
    ptx = _compile(short_conv_triton._short_conv_kernel, ptrs, ints, consts, divisible, num_warps=4).asm["ptx"]
    if head == hp:
        # (4 lanes a thread at 512 lanes and 4 warps: 8-byte vectors; 8 at 1,024: 16-byte)
        assert re.search(r"ld\.global(\.\w+)*\.v[24]", ptx) and re.search(r"st\.global(\.\w+)*\.v[24]", ptx)
        assert not re.search(r"(ld|st)\.global(\.\w+)*\.b16", ptx)
        assert not re.search(r"(ld|st)\.shared", ptx)
    assert ("div.approx" in ptx) == fast_silu
    ptrs = {"X": "*bf16", "WEIGHT": "*fp32", "STATE": "*bf16", "OUT": "*bf16", "QSTART": "*i64", "SLOTS": "*i64",
            "HAS_CTX": "*i32"}
    ints = {n: "i32" for n in ("C", "PLANE", "stride_xt", "stride_ss", "stride_sc", "stride_sw", "stride_op",
                               "stride_ot")} | {"NORM_C": "i32", "NORM_EPS": "fp32"}
    consts = dict(W=4, W_P=4, SILU=True, BLOCK_C=block_c, HEAD=head, HEAD_P=hp, NORM_HEADS=norm, FAST_SILU=fast_silu)
    assert _compile(short_conv_triton._short_conv_heads_kernel, ptrs, ints, consts, divisible[:2] + divisible[3:],
                    num_warps=4).asm["cubin"]


def test_router_gemm_keeps_chunk_sums_out_of_the_mma_accumulator():
    """The prefill router GEMM (``moe_triton.ROUTER_PREFILL_KERNEL``) on Hopper: bf16 wgmma per
    chunk of D, and the chunks summed outside it (the runtime ``one`` multiplies each chunk's MMA
    result before the fp32 add: ``fma`` on every accumulator element), not chained through the MMA
    accumulator as a plain K loop would."""
    ptrs = {"X": "*bf16", "W": "*bf16", "OUT": "*fp32"}
    ints = {n: "i32" for n in ("T", "E", "D", "stride_x")} | {"one": "fp32"}
    kernel = _compile(moe_triton._router_gemm_kernel, ptrs, ints,
                      dict(BLOCK_T=128, BLOCK_E=128, BLOCK_D=64, BF16_MMA=True), tuple(ptrs) + ("D", "stride_x"),
                      num_warps=8, num_stages=3)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and kernel.asm["cubin"]
    assert len(re.findall(r"\bfma\.rn\.f32", ptx)) >= 128 * 128 // 256  # each thread's accumulator elements


@pytest.mark.parametrize("persistent", [True, False])
def test_gemv_chain_compiles_for_sm90(persistent):
    """bench/gemv_chain.py's kernel: the persistent form's grid barrier (acquire spin, acq_rel
    ticket) and the per-stage form's PDL wait after its first weight tile's load."""
    from bench.gemv_chain import _chain_kernel

    ptrs = {"ACT": "*bf16", "W": "*bf16", "DIMS": "*i32", "WOFF": "*i64", "AOFF": "*i64", "COUNTER": "*i32"}
    consts = dict(BLOCK_N=8, BLOCK_K=512, BLOCK_KF=1024, PERSISTENT=persistent, USE_PDL=not persistent)
    kernel = _compile(_chain_kernel, ptrs, {"first_stage": "i32", "num_stages": "i32"}, consts, tuple(ptrs),
                      num_warps=4)
    ptx = kernel.asm["ptx"]
    if persistent:
        # the spin (an add of 0 with acquire: lowered to an acquire load) and the acq_rel ticket
        assert re.search(r"(ld|atom)\.global\.gpu\.acquire", ptx) and "atom.global.gpu.acq_rel.add" in ptx
    else:
        assert "griddepcontrol.wait" in ptx
    assert kernel.asm["cubin"]


@pytest.mark.parametrize("bulk", [True, False])
def test_l2_prefetch_compiles_for_sm90(bulk):
    """bench/l2_prefetch.py's hint kernel: the bulk L2 prefetch or eight line prefetches a lane,
    kept although they produce nothing the kernel uses."""
    from bench.l2_prefetch import _prefetch_l2_kernel

    kernel = _compile(_prefetch_l2_kernel, {"PTR": "*u8"}, {"nbytes": "i64"},
                      dict(CHUNK=16384 if bulk else 1024, LANES=128, BULK=bulk), ("PTR",), num_warps=4)
    ptx = kernel.asm["ptx"]
    if bulk:
        assert "cp.async.bulk.prefetch.L2.global" in ptx
    else:
        assert ptx.count("prefetch.global.L2::evict_last") == 8
    assert kernel.asm["cubin"]


@pytest.mark.parametrize("block_n, block_k, ring, warps, mma, trace",
                         [(16, 256, 8, 4, False, False), (64, 128, 8, 8, False, True), (64, 256, 4, 4, True, False)])
def test_gemv_chain_tma_compiles_for_sm90(block_n, block_k, ring, warps, mma, trace):
    """bench/gemv_chain.py's Gluon TMA form: bulk tensor copies into the shared-memory ring on
    mbarriers, the fp32 sums' atomics, the grid barrier's acquire spin and release arrival (and the
    trace's global timer). Timed and checked on the GPU."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench.gemv_chain import tma_kernel

    layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
    ptrs = {"ACT": "*fp32", "TAB": "*i32", "COUNTER": "*i32", "TIMES": "*i64"}
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, MAX_KB=4096 // block_k, MAX_ROWS=64, RING=ring, WARPS=warps,
                  MMA=mma, TRACE=trace)
    sig = {"desc": f"tensordesc<bf16[{block_n}, {block_k}],{layout!r}>", **ptrs, "num_stages": "i32",
           **{k: "constexpr" for k in consts}}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    kernel = triton.compile(GluonASTSource(fn=tma_kernel(), signature=sig, constexprs=consts, attrs=attrs),
                            target=HOPPER, options=dict(num_warps=warps))
    ptx = kernel.asm["ptx"]
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::(cta|cluster)\.global", ptx)
    assert "mbarrier.try_wait.parity" in ptx
    # fire-and-forget sums and arrival (no atom waiting for an old value), the acquire spin
    assert "red.relaxed.gpu.global.add.f32" in ptx and "red.relaxed.gpu.global.add.u32" in ptx
    # the acquire spin; the chain's table read from shared memory: the only global loads are the spin's
    assert not re.search(r"atom\.global(\.\w+)*\.add", ptx)
    assert re.findall(r"ld\.global[.\w]*", ptx) == ["ld.global.gpu.acquire.b32"] * 2
    assert ("%globaltimer" in ptx) == trace
    assert ("wgmma.mma_async" in ptx) == mma
    assert kernel.asm["cubin"]


@pytest.mark.parametrize("block_n, block_k, ring, warps, pdl", [(32, 256, 9, 4, True), (64, 256, 6, 8, False)])
def test_prefetch_gemv_compiles_for_sm90(block_n, block_k, ring, warps, pdl):
    """bench/prefetch_gemv.py's Gluon GEMV: its TMA copies issued before the PDL wait, the input
    row's cp.async copies after it, the split row blocks' fp32 atomics and acq_rel tickets.
    Timed and checked against float64 on the GPU."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench.prefetch_gemv import prefetch_gemv_kernel

    layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
    ptrs = {"X": "*bf16", "Y": "*bf16", "S": "*fp32", "TICKETS": "*i32"}
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, MAX_KB=4096 // block_k, RING=ring, WARPS=warps, USE_PDL=pdl)
    sig = {"desc": f"tensordesc<bf16[{block_n}, {block_k}],{layout!r}>", **ptrs, "N": "i32", "K": "i32",
           **{k: "constexpr" for k in consts}}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, "N", "K")}
    kernel = triton.compile(GluonASTSource(fn=prefetch_gemv_kernel(), signature=sig, constexprs=consts,
                                           attrs=attrs), target=HOPPER, options=dict(num_warps=warps))
    ptx = kernel.asm["ptx"]
    copies = [m.start() for m in re.finditer(r"cp\.async\.bulk\.tensor\.2d\.shared::(cta|cluster)\.global", ptx)]
    assert len(copies) >= 2  # the ring's first fill and its refill
    if pdl:  # the first fill is issued before the wait
        assert copies[0] < ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
    else:
        assert "griddepcontrol" not in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx and re.search(r"(red|atom)\.global\.gpu(\.relaxed)?\.add\.f32", ptx)
    assert kernel.asm["cubin"]


@pytest.mark.parametrize("read", [False, True])
def test_hop_cost_link_compiles_for_sm90(read):
    """bench/hop_cost.py's link kernel: the PDL wait before any memory access."""
    from bench.hop_cost import _link_kernel

    ptx = _compile(_link_kernel, {"IN": "*bf16", "OUT": "*bf16"}, {"D": "i32"},
                   dict(READ=read, BLOCK=4096, USE_PDL=True), num_warps=4).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert wait >= 0 and all(ptx.find(op) == -1 or ptx.find(op) > wait for op in ("ld.global", "st.global"))
    assert ("ld.global" in ptx) == read


def _attn_res_token(sources: int, tokens: int, trace: bool = False, summary: bool = False, **flags):
    """The program-a-token AttnRes mixer at K3's width (7,168) for sm_90, its tiles and flags from
    ``launch_shape`` (so from the module's constants), ``flags`` over them; ``summary``: a block
    summary's row and the partial (sources 2)."""
    from k3serve.ops import attn_res_triton

    ptrs = {"SRC": "*bf16", "QW": "*fp32", "OUTW": "*bf16", "OUT": "*bf16", "DELTA": "*bf16",
            **({"SUM": "*bf16", "LOGIT": "*fp32"} if summary else {})}
    scalars = {n: "i32" for n in ("stride_src_m", "stride_src_t", "stride_out_t", "stride_delta_t", "M", "D",
                                  "stride_sum_t")}
    consts = dict(HAS_OUT_NORM=True, HAS_DELTA=True, RESET=False, USE_PDL=True, SUMMARY=summary,
                  **({} if summary else {"SUM": None, "LOGIT": None}),
                  **attn_res_triton.launch_shape(sources, 7168, tokens), **({} if trace else {"TRACE": None}))
    consts.update(flags)
    warps = consts.pop("num_warps")
    return _compile(attn_res_triton._attn_res_kernel, {**ptrs, **({"TRACE": "*i64"} if trace else {})},
                    {**scalars, "eps": "fp32"}, consts, (*ptrs, *(n for n in scalars if n != "M")), num_warps=warps)


def _attn_res_split(sources: int, tokens: int, trace: bool = False, summary: bool = False, **flags):
    """The split AttnRes mixer at K3's width for sm_90 (256 columns a program), ``flags`` over the
    served constexprs; ``summary``: a block summary's launch (K3's 24 queries a block)."""
    import torch

    from k3serve.ops import attn_res_triton

    shape = attn_res_triton.split_shape(sources, 7168, tokens, torch.device("cpu"))
    assert shape is not None and shape["COLS"] == 256
    ptrs = {"SRC": "*bf16", "QW": "*fp32", "OUTW": "*bf16", "OUT": "*bf16", "DELTA": "*bf16", "PART": "*fp32",
            "TICKETS": "*i64", **({"SUM": "*bf16", "LOGIT": "*fp32"} if summary else {})}
    scalars = {n: "i32" for n in ("group0", "stride_src_m", "stride_src_t", "stride_out_t", "stride_delta_t", "M",
                                  "D", "Q", "stride_q", "stride_sum_q", "stride_sum_t")}
    consts = dict(HAS_OUT_NORM=True, BLOCK_M=16, PHASE=0, IEEE=False, HAS_DELTA=True, RESET=False, USE_PDL=True,
                  BLOCK_Q=attn_res_triton.SUMMARY_ROWS if summary else 1, SUMMARY=summary,
                  **({} if summary else {"SUM": None, "LOGIT": None}), **shape, **({} if trace else {"TRACE": None}))
    consts.update(flags)
    return _compile(attn_res_triton._attn_res_split_kernel, {**ptrs, **({"TRACE": "*i64"} if trace else {})},
                    {**scalars, "eps": "fp32"}, consts,
                    (*ptrs, *(n for n in scalars if n not in ("M", "group0", "Q"))),
                    num_warps=max(8 if summary else 4, min(16, shape["COLS"] // 128)))


@pytest.mark.parametrize("tokens", [1, 4096])
@pytest.mark.parametrize("sources", [2, 9, 16])
def test_attn_res_kernel_keeps_k3_rows_in_registers(sources, tokens):
    """The AttnRes mixer at K3's width (7,168) and 2 / 9 (the spec's most) / 16 sources (what the
    model lets through to it): its [blocks, CHUNK] tiles fit the registers, nothing spills to local
    memory (an earlier [sources, D] tile spilled ~12 KB a thread at 16 sources), in both tile sizes
    (a decode step's few tokens, a prefill's many)."""
    from bench.sass_mix import sass_text

    kernel = _attn_res_token(sources, tokens)
    sass = sass_text(kernel)
    assert "STL" not in sass and "LDL" not in sass
    assert "griddepcontrol.wait" in kernel.asm["ptx"]


def test_attn_res_kernel_reads_static_weights_first_and_sums_jointly():
    """The program-a-token mixer at 5 sources x 1 token (one chunk): the static weights' loads
    (the query, the norm weight) before the PDL wait, no store and no source load there; at 9
    (two chunks) nothing before it. The dots and squares summed jointly: at most JOINT_ROUNDS
    shared-memory barrier rounds in all (four separate sums took 14 at 5 sources)."""
    one, two = _attn_res_token(5, 1).asm["ptx"], _attn_res_token(9, 1).asm["ptx"]
    early = one[:one.find("griddepcontrol.wait")]
    assert len(re.findall(r"ld\.global", early)) >= 2 and "st.global" not in early
    assert "ld.global" not in two[:two.find("griddepcontrol.wait")]
    assert one.count("bar.sync") <= JOINT_ROUNDS, one.count("bar.sync")


def test_attn_res_token_trace_reads_the_global_timer():
    """bench/attn_res_trace.py --token: the program-a-token kernel's four stamps, none without TRACE."""
    for trace in (True, False):
        kernel = _attn_res_token(5, 1, trace, HAS_DELTA=False, USE_PDL=False)
        assert kernel.asm["ptx"].count("%globaltimer") == (4 if trace else 0)


@pytest.mark.parametrize("tokens", [1, 4])
def test_attn_res_split_kernel_keeps_k3_columns_in_registers_and_waits_on_its_token(tokens):
    """The split mixer at K3's width and 16 sources (the most it takes), at the shapes a decode
    step launches (1 and 4 tokens, SPLIT_TOKENS: 256 columns a program): no spill, the Gram
    matrix through the tensor cores, the barrier's atomics (ops/tickets.py barrier), and the other
    programs' parts read past L1 (.cg), only the weights read before the PDL wait."""
    from bench.sass_mix import sass_text

    kernel = _attn_res_split(16, tokens)
    sass, ptx = sass_text(kernel), kernel.asm["ptx"]
    assert "STL" not in sass and "LDL" not in sass
    assert "HMMA" in sass
    # the growing barrier on int64 counts: a release arrival whose old value sets the target, acquire
    # polls (an add of 0), and no atomic after them (nothing resets the count)
    assert re.search(r"atom\.global\.gpu\.release\.add\.u64", ptx) and "ld.global.gpu.acquire.b64" in ptx
    assert "relaxed" not in ptx
    assert "ld.global.cg" in ptx
    # before the PDL wait only the static weights' two loads (the query, the norm weight), no store
    before_wait = ptx[:ptx.find("griddepcontrol.wait")]
    assert len(re.findall(r"ld\.global", before_wait)) == 2 and "st.global" not in before_wait


@pytest.mark.parametrize("tokens", [1, 4])
def test_attn_res_block_summary_compiles_for_sm90(tokens):
    """A block summary at K3's width, 8 blocks and 24 queries (a block's mixers), 1 and 4 tokens:
    no spill under the device's Triton (3.6; a few spill stores under 3.9, of the 28 parts' loads
    in flight), its products on the tensor cores (the Gram, and the queries' and the weights'
    three bf16 parts), the growing barrier, only the static queries and norm weight read before
    the PDL wait; and
    the mixer that reads a summary row (its high and low rows and the partial): no spill, the
    static weights first, no more barrier rounds than a program-a-token mixer of plain sources."""
    from bench.sass_mix import sass_text

    kernel = _attn_res_split(8, tokens, summary=True)
    ptx, sass = kernel.asm["ptx"], sass_text(kernel)
    assert sass.count("STL") <= (0 if triton.__version__.startswith("3.6") else 16), sass.count("STL")
    assert sass.count("HMMA") >= 7 * 4  # (the Gram's, the queries' three, the weights' three)
    assert re.search(r"atom\.global\.gpu\.release\.add\.u64", ptx)
    before_wait = ptx[:ptx.find("griddepcontrol.wait")]
    assert "st.global" not in before_wait and len(re.findall(r"ld\.global", before_wait)) >= 2
    mixer = _attn_res_token(3, tokens, summary=True)
    ptx, sass = mixer.asm["ptx"], sass_text(mixer)
    assert "STL" not in sass and "LDL" not in sass
    before_wait = ptx[:ptx.find("griddepcontrol.wait")]
    assert "st.global" not in before_wait and len(re.findall(r"ld\.global", before_wait)) >= 2
    assert ptx.count("bar.sync") <= _attn_res_token(3, tokens).asm["ptx"].count("bar.sync")


def test_attn_res_split_trace_reads_the_global_timer():
    """bench/attn_res_trace.py's stamps: four global-timer reads and stores, none without TRACE."""
    for trace in (True, False):
        kernel = _attn_res_split(9, 1, trace, HAS_DELTA=False, USE_PDL=False)
        assert kernel.asm["ptx"].count("%globaltimer") == (4 if trace else 0)


def test_combine_normalised_in_column_blocks_compiles_for_sm90():
    """K3's latent combine split in column blocks (16 expert rows, 3,584 columns): the token's
    last block (a ticket) normalises the row from the parts, read past L1."""
    ptrs = {"Y": "*fp32", "NORM_W": "*bf16", "ADD": "*fp32", "OUT": "*bf16", "PART": "*fp32", "TICKETS": "*i32"}
    consts = dict(TOP_K=16, NORM=True, HAS_ADD=False, BLOCK=moe_triton.COMBINE_NORM_BLOCK,
                  SPLIT=-(-3584 // moe_triton.COMBINE_NORM_BLOCK), ROW=4096, USE_PDL=True)
    kernel = _compile(moe_triton._combine_kernel, ptrs, {"D": "i32", "stride_add": "i32", "eps": "fp32"}, consts,
                      (*ptrs, "D"), num_warps=4)
    ptx = kernel.asm["ptx"]
    assert "ld.global.cg" in ptx and "atom.global.gpu.acq_rel.add" in ptx
    assert "griddepcontrol.wait" in ptx and kernel.asm["cubin"]


@pytest.mark.parametrize("skip", [False, True])
def test_sort_free_sampling_compiles_in_one_launch_for_sm90(skip):
    """ops/sampling_triton.py's GPU form: every phase in one launch, the row's programs meeting at
    grid barriers (acquire spins on the int64 counts); no spills, and without skipping blocks at most
    128 registers a thread (two programs an SM past the SMs' count of rows: what its BLOCK was chosen
    for; skipping is used only below it, ``SKIP``)."""
    from bench.sass_mix import registers, sass_text
    from k3serve.ops import sampling_triton

    ptrs = {"X": "*fp32", "ROWS": "*i64", "Q": "*fp32", "PARAMS": "*fp32", "PART": "*fp32", "COUNTS": "*i64",
            "OUT": "*i64", "TAU": "*i64", "BMAX": "*fp32"}
    scalars = {n: "i32" for n in ("V", "S", "stride_x", "stride_q", "P")}
    consts = dict(NB_P=64, HAS_K=True, HAS_P=True, HAS_MIN=True, PHASE=0, BLOCK=sampling_triton.BLOCK,
                  GROUP=sampling_triton.GROUP_SIZE // sampling_triton.BLOCK, STAGES=sampling_triton.STAGES,
                  SKIP=skip)
    # (16-aligned rows and vocabulary, as kimi-linear's 163,840 and the launch specialise them)
    compiled = _compile(sampling_triton._sample_kernel, ptrs, scalars, consts, (*ptrs, "V", "stride_x", "stride_q"),
                        num_warps=sampling_triton.WARPS)
    ptx = compiled.asm["ptx"]
    assert ptx.count("atom.global.gpu.release.add") == 1 + 8 + 8 + 1  # a barrier a phase
    assert "STL" not in sass_text(compiled) and registers(compiled) <= (255 if skip else 128)
