"""The bf16 head's two kernels as LLVM IR, written with llvmlite's IR builder (compiled in model/head_bf16_cpu.py).

logits[r, v] = sum over the model dimension of y[r, k] * w[v, k], w the head's bf16 bits. Both kernels walk the
packed weight [blocks, dim / 2, BLOCK] (each uint32 the bf16 pair of channels 2k and 2k + 1 of one vocabulary row,
the even channel in the low half): a block of BLOCK vocabulary rows at a time, its rows of y in tiles of `tile`
rows whose tile x BLOCK / 16 accumulators (16 fp32 lanes each) stay in vector registers while the block's
weights stream from memory once and, for the tiles after the first, from L1.

- `head_fma` (y fp32): each weight widened to fp32 (a 16-bit shift), one fused multiply-add a term, over the
  dimension in order: a logit is fma(y[k], w[k], acc) for k = 0, 1, ..., rounded once a term.
- `head_dot` (y bf16, CPUs with AVX512_BF16): `vdpbf16ps`, a pair of channels an instruction. Its arithmetic (the
  ISA's, checked bit for bit on this CPU by tests/unit/test_cpu_head.py): acc = fma(y[2k+1], w[2k+1], acc), then
  acc = fma(y[2k], w[2k], acc), inputs and outputs flushed to zero below fp32's normal range; bf16 products are
  exact in fp32, so only the sums round. Twice the multiplies of `head_fma` an instruction.

Either way a row's logits depend on that row alone, in the same order whatever tile it falls in: the head is
batch invariant. Written as IR rather than compiled from Python because numba has no vector types (the
accumulators must be registers, not memory) and no way to reach `vdpbf16ps`.
"""

from __future__ import annotations

from llvmlite import ir

BLOCK = 64  # vocabulary rows a block: 4 vectors of 16 fp32 accumulators a row of y
LANES = 16  # fp32 lanes a vector (one AVX-512 register; two AVX2 ones)
VECTORS = BLOCK // LANES

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_VF, _VI = ir.VectorType(_F32, LANES), ir.VectorType(_I32, LANES)
_DOT = "llvm.x86.avx512bf16.dpbf16ps.512"  # declared on <16 x i32>: LLVM upgrades it to its bfloat form


def _i64(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _splat(b: ir.IRBuilder, scalar: ir.Value, vector: ir.VectorType) -> ir.Value:
    undef = ir.Constant(vector, ir.Undefined)
    one = b.insert_element(undef, scalar, ir.Constant(_I32, 0))
    return b.shuffle_vector(one, undef, ir.Constant(_VI, [0] * LANES))


def _tile(module: ir.Module, rows: int, dot: bool) -> ir.Function:
    """tile(x, x_stride, pairs, w, out, out_stride): `rows` rows of y against one block; pairs = dim / 2."""
    x_type = ir.PointerType(_I32 if dot else _F32)
    signature = ir.FunctionType(ir.VoidType(), [x_type, _I64, _I64, ir.PointerType(_I32), ir.PointerType(_F32), _I64])
    fn = ir.Function(module, signature, f"{'dot' if dot else 'fma'}_tile{rows}")
    fn.linkage = "internal"
    x, x_stride, pairs, w, out, out_stride = fn.args
    entry, loop, done = (fn.append_basic_block(name) for name in ("entry", "loop", "done"))
    ir.IRBuilder(entry).branch(loop)
    b = ir.IRBuilder(loop)
    k = b.phi(_I64)
    k.add_incoming(_i64(0), entry)
    acc = [[b.phi(_VF) for _ in range(VECTORS)] for _ in range(rows)]
    for phi in (p for row in acc for p in row):
        phi.add_incoming(ir.Constant(_VF, [0.0] * LANES), entry)
    wide = []  # the block's weights at pair k: VECTORS x <16 x i32>
    for q in range(VECTORS):
        at = b.gep(w, [b.add(b.mul(k, _i64(BLOCK)), _i64(q * LANES))])
        wide.append(b.load(b.bitcast(at, ir.PointerType(_VI)), align=4))
    nxt = []
    if dot:
        dpbf16 = module.globals.get(_DOT) or ir.Function(module, ir.FunctionType(_VF, [_VF, _VI, _VI]), _DOT)
        for r in range(rows):
            pair = _splat(b, b.load(b.gep(x, [b.add(b.mul(_i64(r), x_stride), k)]), align=4), _VI)
            nxt.append([b.call(dpbf16, [acc[r][q], pair, wide[q]]) for q in range(VECTORS)])
    else:
        fma = module.globals.get("llvm.fma.v16f32") or ir.Function(
            module, ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v16f32"
        )
        even = [b.bitcast(b.shl(v, ir.Constant(_VI, [16] * LANES)), _VF) for v in wide]
        odd = [b.bitcast(b.and_(v, ir.Constant(_VI, [-65536] * LANES)), _VF) for v in wide]
        for r in range(rows):
            row = b.add(b.mul(_i64(r), x_stride), b.mul(k, _i64(2)))
            y0 = _splat(b, b.load(b.gep(x, [row]), align=4), _VF)
            y1 = _splat(b, b.load(b.gep(x, [b.add(row, _i64(1))]), align=4), _VF)
            nxt.append([b.call(fma, [y1, odd[q], b.call(fma, [y0, even[q], acc[r][q]])]) for q in range(VECTORS)])
    k_next = b.add(k, _i64(1))
    k.add_incoming(k_next, loop)
    for r in range(rows):
        for q in range(VECTORS):
            acc[r][q].add_incoming(nxt[r][q], loop)
    b.cbranch(b.icmp_signed("<", k_next, pairs), loop, done)
    b = ir.IRBuilder(done)
    for r in range(rows):
        for q in range(VECTORS):
            at = b.gep(out, [b.add(b.mul(_i64(r), out_stride), _i64(q * LANES))])
            b.store(nxt[r][q], b.bitcast(at, ir.PointerType(_VF)), align=4)
    b.ret_void()
    return fn


def _driver(module: ir.Module, name: str, tile: int, dot: bool) -> None:
    """name(x, rows, dim, w, blocks, out, out_stride): every block, its rows in tiles of `tile`, the rest in one."""
    tiles = {n: _tile(module, n, dot) for n in range(1, tile + 1)}
    x_type = ir.PointerType(_I32 if dot else _F32)
    signature = ir.FunctionType(
        ir.VoidType(), [x_type, _I64, _I64, ir.PointerType(_I32), _I64, ir.PointerType(_F32), _I64]
    )
    fn = ir.Function(module, signature, name)
    x, rows, dim, w, blocks, out, out_stride = fn.args
    entry, block, full, rest, next_block, done = (
        fn.append_basic_block(n) for n in ("entry", "block", "full", "rest", "next_block", "done")
    )
    b = ir.IRBuilder(entry)
    pairs = b.sdiv(dim, _i64(2))
    x_stride = pairs if dot else dim  # x's elements a row: bf16 pairs or fp32 values
    whole = b.mul(b.sdiv(rows, _i64(tile)), _i64(tile))
    b.branch(block)

    b = ir.IRBuilder(block)
    i = b.phi(_I64)
    i.add_incoming(_i64(0), entry)
    w_block = b.gep(w, [b.mul(i, b.mul(pairs, _i64(BLOCK)))])
    out_block = b.gep(out, [b.mul(i, _i64(BLOCK))])
    b.cbranch(b.icmp_signed(">", whole, _i64(0)), full, rest)

    def call(b: ir.IRBuilder, n: int, r: ir.Value) -> None:
        args = [b.gep(x, [b.mul(r, x_stride)]), x_stride, pairs, w_block, b.gep(out_block, [b.mul(r, out_stride)])]
        b.call(tiles[n], [*args, out_stride])

    b = ir.IRBuilder(full)
    r = b.phi(_I64)
    r.add_incoming(_i64(0), block)
    call(b, tile, r)
    r_next = b.add(r, _i64(tile))
    r.add_incoming(r_next, full)
    b.cbranch(b.icmp_signed("<", r_next, whole), full, rest)

    b = ir.IRBuilder(rest)
    switch = b.switch(b.sub(rows, whole), next_block)
    for n in range(1, tile):
        case = fn.append_basic_block(f"rest{n}")
        switch.add_case(_i64(n), case)
        cb = ir.IRBuilder(case)
        call(cb, n, whole)
        cb.branch(next_block)

    b = ir.IRBuilder(next_block)
    i_next = b.add(i, _i64(1))
    i.add_incoming(i_next, next_block)
    b.cbranch(b.icmp_signed("<", i_next, blocks), block, done)
    ir.IRBuilder(done).ret_void()


def module_ir(triple: str, fma_tile: int, dot_tile: int | None) -> str:
    """The IR of `head_fma` (rows in tiles of fma_tile) and, when dot_tile is given, `head_dot`."""
    module = ir.Module("dsv4serve_head_bf16")
    module.triple = triple
    _driver(module, "head_fma", fma_tile, dot=False)
    if dot_tile is not None:
        _driver(module, "head_dot", dot_tile, dot=True)
    return str(module)
